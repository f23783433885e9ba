"""Speed and memory benchmark: simulated requests per wall-second and peak memory.

``python run_sim.py bench [--sizes 10000,100000] [--policies no-spec,fixed-k,goodput+ngram]`` runs each case in a fresh
process (so start-up is counted and peak memory is that run's own), with request lengths sampled from
the Azure LLM 2023 conversation trace (Splitwise, ISCA 2024; CC-BY 4.0; shipped, :data:`simulator.inputs.AZURE_CONV`);
Poisson arrivals at 4 req/s; the shipped analytical
Llama-2-7B (A100-80GB) cost model, the setting Vidur's reference numbers come from. It prints a table, each speed
with its ratio to the first policy's; the figures are noisy on shared machines, so compare ratios, not seconds, and
``--repeat N`` runs the policies in N interleaved rounds and prints medians and the ratios' range. At this load
no-spec runs past its capacity (its queue grows: mean latency about 52 s at 10,000 requests, goodput's about 3 s), so it
serves the same tokens in fewer, fuller steps (33k against goodput's 79k): a policy's speed here is its steps' cost
and their number. Then (``--calls N``, 0 to skip) the
microseconds per call of the cost-model methods the engine calls millions of times a run. A policy may carry
variants: ``+ngram`` (n-gram proposer), ``+chunked`` (chunked prefill), ``+tree`` (SGLang's default EAGLE token tree
of 7 nodes, k = 7), ``+NAME=VALUE`` (a policy parameter);
``threshold`` runs with ``max_batch=8`` (it then speculates in about 1% of its decode steps here: the batch is
larger), ``threshold+max_batch=32`` in about two thirds of them. ``--profile`` prices every case with another profile.

``--fleet N`` (issue 24, item 4) measures a fleet instead: N replicas behind the least-outstanding router serving
``--fleet-requests`` requests (default 1,000,000) at ``--fleet-rate`` requests/s per replica (default 3: about three
quarters of one replica's capacity here; at 4 one replica is at saturation, its queue grows and its batches fatten,
which flatters its speed), against one replica at the same per-replica rate serving ``requests / N`` of them, or
:data:`SINGLE_REQUESTS` when that is more (a shorter run's figure is mostly start-up), each policy of ``--policies`` in
its own processes; it prints requests per wall-second (the whole process, and the
simulation alone), their ratio (fleet / one replica), the same per CPU-second of the simulation (steadier where other
jobs share the machine) and each process's peak memory.

``--fleet-trace NAME|FILE`` (issue 30) replays a request trace instead (``mooncake``: Mooncake's conversation trace, its
12,031 requests, or the first ``--fleet-requests``) at ``--fleet-rate`` requests/s per replica on ``--fleet N``
replicas (default 1) for each policy of ``--policies``, each in its own process, and prints each fleet's wall seconds
(the whole process, the simulation alone) and the simulation's CPU seconds against the first policy's, e.g. a goodput
fleet at light load against no-spec's: ``bench --fleet 8 --fleet-trace mooncake --fleet-rate 0.1 --policies
no-spec,goodput``.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from policies.errors import UserError
from simulator.inputs import AZURE_CONV, MOONCAKE



BENCH_PROFILE = Path(__file__).resolve().parents[2] / "profiles" / "data" / \
    "a100-80gb-analytical__llama-2-7b__llama-68m.csv"


#: What a ``+variant`` of a policy in ``--policies`` changes in the case's config (e.g. ``fixed-k+ngram``).
VARIANTS = {"ngram": {"proposer": "ngram"}, "chunked": {"scheduler": "chunked-prefill"},
            # SGLang's documented EAGLE defaults (--speculative-num-steps 5 --speculative-eagle-topk 4
            # --speculative-num-draft-tokens 8): a 7-node token tree, every node verified (k = 7)
            "tree": {"speculative_num_steps": 5, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8,
                     "k": 7}}
#: Parameters of policies that need some (threshold: speculate while at most 8 requests run).
POLICY_PARAMS = {"threshold": (("max_batch", 8),)}


def _case_config(size: int, policy: str, profile: Path = BENCH_PROFILE) -> dict:
    """The case ``policy`` (a policy name, optionally ``+ngram`` / ``+chunked``) of ``size`` requests."""
    name, *variants = policy.split("+")
    config = {"rate": 4.0, "num_requests": size, "policy": name, "k": 4, "seed": 0, "profile": str(profile),
              "policy_params": POLICY_PARAMS.get(name, ())}
    for variant in variants:
        if "=" in variant:  # a policy parameter, e.g. threshold+max_batch=32
            param, _, value = variant.partition("=")
            config["policy_params"] = dict(config["policy_params"]) | {param: int(value) if value.isdigit() else value}
        else:
            config.update(VARIANTS[variant])
    config["policy_params"] = tuple(dict(config["policy_params"]).items())
    config.update(length_dist="file", length_file=str(AZURE_CONV))
    return config


#: Fewest requests the one replica of ``--fleet`` serves (a shorter run measures mostly its start-up).
SINGLE_REQUESTS = 50_000


#: The request traces ``--fleet-trace`` names (else a trace file): Mooncake's conversation trace (with ``hash_ids``).
FLEET_TRACES = {"mooncake": MOONCAKE}


def _fleet_case(requests: int | None, policy: str, replicas: int, rate: float, profile: Path = BENCH_PROFILE,
                trace: Path | None = None) -> dict:
    """The case ``policy`` for ``replicas`` replicas behind the least-outstanding router, ``rate`` requests/s each:
    Poisson arrivals with the Azure conversation lengths, or the first ``requests`` (None: all) of ``trace`` replayed at
    that mean rate."""
    config = _case_config(requests, policy, profile)
    config["rate"] = rate * replicas
    if trace is not None:
        del config["length_dist"], config["length_file"]
        config.update(arrival="trace", trace=str(trace))
    if replicas > 1:
        config.update(replicas=replicas, router="least-outstanding")
    return config


def _run_child(config: dict) -> tuple[float, dict]:
    """Run one case in a fresh process: its wall seconds and figures (:func:`_child`)."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "simulator.studies.bench", "--child", json.dumps(config)],
                         check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, json.loads(out.strip().splitlines()[-1])


def single_table(sizes: list[int], policies: list[str], profile: Path, repeat: int = 1) -> list[str]:
    """The plain bench's lines: per size and policy, each in a fresh process, its steps, wall seconds (the whole
    process), requests per wall-second (the whole process; the simulation alone) and peak memory, with each speed's
    ratio to the first policy's in the same round (this / first). ``repeat`` rounds run every policy once each, in
    order, so that a drift of the machine's speed falls on neighbours; each figure is then the median over the rounds
    and ``range`` the lowest and highest ratio of the whole process's speed."""
    lines = [f"{'requests':>9} {'policy':>16} {'steps':>9} {'process s':>10} {'req/s':>9} {'ratio':>6} "
             f"{'sim-only req/s':>15} {'ratio':>6} {'peak MB':>8}" + (f" {'range':>11}" if repeat > 1 else "")]
    for size in sizes:
        rounds = [[_run_child(_case_config(size, policy, profile)) for policy in policies] for _ in range(repeat)]
        for i, policy in enumerate(policies):
            mine = [row[i] for row in rounds]
            ratios = [row[0][0] / row[i][0] for row in rounds]  # speed over the first's: its wall seconds over these
            sim_ratios = [row[0][1]["sim_wall"] / row[i][1]["sim_wall"] for row in rounds]
            wall = statistics.median(wall for wall, _ in mine)
            sim_wall = statistics.median(fig["sim_wall"] for _, fig in mine)
            line = (f"{size:>9} {policy:>16} {mine[0][1]['steps']:>9} {wall:>10.2f} {size / wall:>9.0f} "
                    f"{statistics.median(ratios):>5.2f}x {size / sim_wall:>15.0f} "
                    f"{statistics.median(sim_ratios):>5.2f}x {max(fig['peak_mb'] for _, fig in mine):>8.0f}")
            lines.append(line + (f" {min(ratios):>5.2f}-{max(ratios):.2f}x" if repeat > 1 else ""))
    return lines


def fleet_table(replicas: int, requests: int, rate: float, policies: list[str], profile: Path) -> list[str]:
    """The ``--fleet`` comparison's lines: per policy, one replica serving ``requests / replicas`` requests (at least
    :data:`SINGLE_REQUESTS`, at most ``requests``) and the fleet serving ``requests``, at ``rate`` requests/s per
    replica."""
    single = min(requests, max(requests // replicas, SINGLE_REQUESTS))
    lines = [f"{'policy':>10} {'replicas':>8} {'requests':>9} {'steps':>10} {'process s':>10} {'req/s':>8} "
             f"{'sim-only req/s':>15} {'ratio':>6} {'CPU req/s':>10} {'ratio':>6} {'peak MB':>8}"]
    for policy in policies:
        base = None
        for count, size in ((1, single), (replicas, requests)):
            wall, fig = _run_child(_fleet_case(size, policy, count, rate, profile))
            speed, cpu = size / fig["sim_wall"], size / fig["sim_cpu"]
            base = (speed, cpu) if base is None else base
            lines.append(f"{policy:>10} {count:>8} {size:>9} {fig['steps']:>10} {wall:>10.1f} {size / wall:>8.0f} "
                         f"{speed:>15.0f} {speed / base[0]:>5.2f}x {cpu:>10.0f} {cpu / base[1]:>5.2f}x "
                         f"{fig['peak_mb']:>8.0f}")
    return lines


def fleet_trace_table(replicas: int, requests: int | None, rate: float, policies: list[str], profile: Path,
                      trace: Path) -> list[str]:
    """The ``--fleet-trace`` comparison's lines: per policy, ``replicas`` replicas serving the first ``requests`` (None:
    all) of ``trace`` at ``rate`` requests/s per replica, each in its own process: its wall seconds (the whole process,
    the simulation alone) and CPU seconds of the simulation, each against the first policy's (ratio: this / first)."""
    lines = [f"{'policy':>10} {'replicas':>8} {'requests':>9} {'steps':>10} {'process s':>10} {'ratio':>6} "
             f"{'sim s':>8} {'ratio':>6} {'sim CPU s':>10} {'ratio':>6} {'peak MB':>8}"]
    base = None
    for policy in policies:
        wall, fig = _run_child(_fleet_case(requests, policy, replicas, rate, profile, trace))
        base = (wall, fig["sim_wall"], fig["sim_cpu"]) if base is None else base
        lines.append(f"{policy:>10} {replicas:>8} {fig['requests']:>9} {fig['steps']:>10} {wall:>10.2f} "
                     f"{wall / base[0]:>5.2f}x {fig['sim_wall']:>8.2f} {fig['sim_wall'] / base[1]:>5.2f}x "
                     f"{fig['sim_cpu']:>10.2f} {fig['sim_cpu'] / base[2]:>5.2f}x {fig['peak_mb']:>8.0f}")
    return lines


def _child(config_json: str) -> None:
    """Run one simulation in this process and print its figures as JSON."""
    from simulator.config import SimConfig
    from simulator.fleet import run as run_config

    cpu = time.process_time()
    result = run_config(SimConfig.from_dict(json.loads(config_json)))
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"steps": result.summary["steps"], "requests": len(result.requests),
                      "sim_wall": result.summary["wall_seconds"],
                      "sim_cpu": time.process_time() - cpu, "peak_mb": peak_mb,
                      "mean_latency": result.summary["mean_latency"]}))


def cost_call_speeds(calls: int) -> list[str]:
    """Microseconds per call of each cost model's per-step methods (the shipped example JSON, and the example
    grid fitted linear and interp), ``calls`` calls each: one line per (model, method)."""
    import warnings

    from simulator.costs.cost_model import load_cost_model

    data = Path(__file__).resolve().parents[2] / "profiles" / "data"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        models = {"json": load_cost_model(data / "example.json"),
                  "linear": load_cost_model(data / "example_grid.csv", "linear"),
                  "interp": load_cost_model(data / "example_grid.csv", "interp")}
    lines = []
    for name, model in models.items():
        for call, args in (("target_time", (32, 96, 32 * 700)), ("draft_time", (32, 32 * 700)),
                           ("overhead_time", (32,))):
            method = getattr(model, call)
            start = time.perf_counter()
            for _ in range(calls):
                method(*args)
            lines.append(f"{name:6s} {call:13s} {(time.perf_counter() - start) / calls * 1e6:6.2f} us/call")
    return lines


def check_cases(sizes: list[int], policies: list[str], profile: Path, fleet: int, fleet_requests: int,
                fleet_rate: float) -> None:
    """Every case the flags ask for is a valid config, each variant and policy known: a bad flag stops the bench
    with one line before any process starts (a child's traceback would say less)."""
    from policies.errors import UserError
    from policies.registry import make_policy
    from simulator.config import SimConfig

    if not profile.is_file():
        raise UserError(f"--profile {profile}: file not found")
    for policy in policies:
        name, *variants = policy.split("+")
        for variant in variants:
            if "=" not in variant and variant not in VARIANTS:
                raise UserError(f"--policies {policy}: unknown variant +{variant} (one of {', '.join(VARIANTS)}, or "
                                "+NAME=VALUE)")
        cases = [_fleet_case(fleet_requests, policy, fleet, fleet_rate, profile)] if fleet else \
            [_case_config(size, policy, profile) for size in sizes]
        for case in cases:
            try:
                spec = SimConfig.from_dict(case).speculative
                make_policy(spec.policy, spec.k, dict(spec.policy_params))
            except UserError as exc:
                raise UserError(f"--policies {policy}: {exc}") from None


def _whole(flag: str, text: str, minimum: int) -> int:
    from policies.errors import UserError

    try:
        value = int(text)
    except ValueError:
        raise UserError(f"{flag}: a whole number >= {minimum}, got {text!r}") from None
    if value < minimum:
        raise UserError(f"{flag}: a whole number >= {minimum}, got {value}")
    return value


def _items(flag: str, text: str) -> list[str]:
    """A comma list's items: at least one, none empty (``a,,b`` or a trailing comma is refused)."""
    from policies.errors import UserError

    items = [item.strip() for item in text.split(",")]
    if not all(items):
        raise UserError(f"{flag}: an empty item in {text!r}")
    return items


def main(argv: list[str]) -> int:
    from policies.errors import FlagParser, UserError
    from simulator.studies.specs import parse_rates

    parser = FlagParser(prog="run_sim.py bench", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="10000,100000",
                        help="request counts, comma-separated, each >= 1 (\"\": none, the per-call table alone)")
    parser.add_argument("--policies", default="no-spec,fixed-k", help="policies, comma-separated")
    parser.add_argument("--calls", default="20000",
                        help="calls per cost-model method in the per-call table (0: no table)")
    parser.add_argument("--profile", type=Path, default=BENCH_PROFILE,
                        help="cost profile of every case (default: the shipped analytical A100 7B profile)")
    parser.add_argument("--fleet", default="0", metavar="N",
                        help="compare N >= 1 replicas behind the least-outstanding router with one replica (0, the "
                             "default: no fleet; the plain bench)")
    parser.add_argument("--fleet-requests",
                        help="requests the fleet serves, >= 1 (one replica serves this / N); default 1,000,000, or "
                             "all of --fleet-trace")
    parser.add_argument("--fleet-rate", default="3",
                        help="arrival rate per replica, requests/s > 0 (default 3)")
    parser.add_argument("--fleet-trace", metavar="NAME|FILE",
                        help="replay this request trace (a name: " + ", ".join(FLEET_TRACES) + "; or a trace file) at "
                             "--fleet-rate per replica and compare the policies' fleets with the first's")
    parser.add_argument("--repeat", default="1", metavar="N",
                        help="rounds of the plain bench, >= 1: every policy runs once a round, in order, and the table "
                             "gives each figure's median over the rounds and the range of its ratios (default 1)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        _child(args.child)
        return 0
    fleet = _whole("--fleet", args.fleet, 0)
    calls = _whole("--calls", args.calls, 0)
    repeat = _whole("--repeat", args.repeat, 1)
    fleet_requests = None if args.fleet_requests is None else _whole("--fleet-requests", args.fleet_requests, 1)
    fleet_rate = parse_rates("--fleet-rate", args.fleet_rate)
    if len(fleet_rate) != 1:
        raise UserError(f"--fleet-rate: one rate, got {args.fleet_rate!r}")
    sizes = [_whole("--sizes", item, 1) for item in _items("--sizes", args.sizes)] if args.sizes.strip() else []
    policies = _items("--policies", args.policies)
    if args.fleet_trace is not None:
        trace = FLEET_TRACES.get(args.fleet_trace, Path(args.fleet_trace))
        if not trace.is_file():
            raise UserError(f"--fleet-trace: {args.fleet_trace!r} is neither a trace name ({', '.join(FLEET_TRACES)}) "
                            "nor a file")
        print(f"fleet: {max(fleet, 1)} replicas, least-outstanding, {trace.name} replayed at {fleet_rate[0]:g} "
              f"req/s per replica, {args.profile}")
        print("\n".join(fleet_trace_table(max(fleet, 1), fleet_requests, fleet_rate[0], policies, args.profile,
                                          trace)))
        return 0
    fleet_requests = 1_000_000 if fleet_requests is None else fleet_requests
    check_cases(sizes, policies, args.profile, fleet, fleet_requests, fleet_rate[0])
    if fleet > 0:
        print(f"fleet: {fleet} replicas, least-outstanding, Poisson {fleet_rate[0]:g} req/s per replica, "
              f"Azure conv trace lengths, {args.profile}")
        print("\n".join(fleet_table(fleet, fleet_requests, fleet_rate[0], policies, args.profile)))
        return 0
    print(f"Poisson 4 req/s, Azure conv trace lengths, {args.profile}, k=4 for fixed-k"
          + (f"; medians of {repeat} rounds" if repeat > 1 else ""))
    for line in single_table(sizes, policies, args.profile, repeat):
        print(line)
    if calls > 0:
        print(f"cost-model calls ({calls} each):")
        print("\n".join(cost_call_speeds(calls)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
