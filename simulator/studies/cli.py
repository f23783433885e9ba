"""The simulator's command line behind ``run_sim.py``: simulate, sweep, plot, tune, demo, bench (``run_sim.py``
itself adds the profiles side's ``profile`` and ``validate``). Nothing in the library imports this module; the
parsing of values, specs, grids and SLOs lives in :mod:`simulator.studies.specs`.

Every config field is a flag named after it (``max_num_seqs`` -> ``--max-num-seqs``), in one help group per concern;
``--config FILE`` starts from a saved ``config.json``. A user error prints one line and exits 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any, Callable, Iterable

from policies.errors import EXIT_USER_ERROR, FlagParser, UserError, one_line_warnings
from policies.tree import tree_nodes
from simulator.config import (CONCERN_OF, CONCERNS, FIELDS, SimConfig, align_proposer, flag_value, flags_of,
                              flat_fields)
from simulator.studies.compare import read_result_csv as _read_result_csv, warn_saturated
from simulator.studies.engine_flags import speculative_config_fields
from simulator.studies.specs import (field_kind, parse_field_value, parse_goodput, parse_grid, parse_policy_list,
                                     parse_policy_params, parse_rates, parse_seeds, parse_slo)


# -- config flags --------------------------------------------------------------------------------
#: The help heading of each concern's flags (:data:`simulator.config.CONCERNS`).
CONCERN_HEADINGS = {
    "workload": "workload (the client: arrivals, request lengths, concurrency; units: seconds, tokens, req/s)",
    "engine": "engine (scheduling and KV cache, vLLM's terms; units: tokens, sequences, GiB)",
    "fleet": "fleet (replicas and routers; disaggregated prefill and decode)",
    "speculative": "speculative decoding (policy, proposer, token tree, acceptance)",
    "cost": "cost model (the profile that prices each step)",
    "run": "run (seed, recording, goodput SLOs)",
}


def field_docs() -> dict[str, str]:
    """Each config field's docstring (the string under it in its concern's class, :mod:`simulator.config`),
    whitespace collapsed and reST markup dropped: the help of its flag."""
    import ast
    import inspect
    import re
    import textwrap

    docs = {}
    for cls in CONCERNS.values():
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
        for node, after in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr) \
                    and isinstance(getattr(after, "value", None), ast.Constant) and isinstance(after.value.value, str):
                text = " ".join(after.value.value.split()).replace("``", "")
                docs[node.target.id] = re.sub(r":[a-z]+:`([^`]*)`", r"\1", text)
    return docs


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """One flag per config field, its help the field's docstring and default, in one group per concern; unset flags
    keep the defaults."""
    parser.add_argument("--config", metavar="FILE", help="start from this config.json (a run's saved config; flags "
                                                         "override it)")
    docs = field_docs()
    groups = {concern: parser.add_argument_group(heading) for concern, heading in CONCERN_HEADINGS.items()}
    for name, f in FIELDS.items():
        group, names = groups[CONCERN_OF[name]], flags_of(name)
        kind = field_kind(name)
        default = "" if f.default is MISSING else f" (default: {_shown_default(name, f.default)})"
        doc = (docs.get(name, "") + default).replace("%", "%%")
        if name == "policy_params":
            group.add_argument(*names, dest=name, action="append", metavar="NAME=VALUE",
                               help=doc + "; repeat for several")
        elif name == "goodput_slo":
            group.add_argument(*names, dest=name, nargs="+", metavar="METRIC:MS", default=None, help=doc)
        elif kind is bool:
            group.add_argument(*names, dest=name, action="store_true", default=None, help=doc)
        else:
            group.add_argument(*names, dest=name, default=None, metavar=name.upper(), help=doc)
    # vLLM's flags for fields named otherwise here (:func:`_vllm_flags`), beside those fields
    groups["workload"].add_argument(
        "--burstiness", metavar="B", default=None,
        help="vLLM's --burstiness: Gamma arrivals of shape B, > 0 (1 = Poisson, < 1 burstier); the same as --arrival "
             "gamma --cv 1/sqrt(B)")
    groups["workload"].add_argument(
        "--dataset-path", metavar="FILE", default=None,
        help="vLLM's --dataset-path: request lengths sampled from this ShareGPT JSON dataset (or length CSV); the same "
             "as --length-dist file --length-file FILE")
    groups["engine"].add_argument(
        "--enable-chunked-prefill", action="store_true", default=None,
        help="vLLM's --enable-chunked-prefill (v0; always on in the V1 scheduler): the same as --scheduler "
             "chunked-prefill")
    groups["workload"].add_argument(
        "--dataset-name", choices=("sharegpt",), default=None,
        help="vLLM's --dataset-name; only sharegpt (with --dataset-path) is read here")


def add_speculative_config_flag(parser: argparse.ArgumentParser) -> None:
    """vLLM's ``--speculative-config JSON`` (``simulate``, ``sweep``), read by
    :func:`simulator.studies.engine_flags.parse_speculative_config`."""
    parser.add_argument(
        "--speculative-config", metavar="JSON", default=None,
        help="vLLM's --speculative-config: a JSON object of method, model (the profile's draft), "
             "num_speculative_tokens, speculative_token_tree, num_speculative_tokens_per_batch_size ([[start, end, k], "
             "...]: the vllm-batch-table policy; else fixed-k) and, for ngram, prompt_lookup_min/max; another key is "
             "refused. It sets --policy, --k, --speculative-method and the tree: give those once")


def _shown_default(name: str, value: Any) -> str:
    if name == "profile":
        return "profiles/data/example.json"
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) if value else "none"
    return str(value)


def config_from_args(args: argparse.Namespace, **defaults: Any) -> SimConfig:
    """Resolve the config: field defaults, then ``defaults``, then a ``--config`` file, then flags."""
    data, _ = config_data(args, **defaults)
    return SimConfig.from_dict(data, source=args.config or "flags")


def calibrated_config(args: argparse.Namespace, runs: Callable[[SimConfig], Iterable[SimConfig]] | None = None,
                      **defaults: Any) -> SimConfig:
    """:func:`config_from_args`, with the vLLM settings a calibrated ``--profile`` was fitted with
    (:func:`simulator.costs.profile_table.calibration_settings`; a mixed fleet's, when every profile of ``--replicas``
    records the same) taken as defaults: field defaults, then ``defaults``,
    then the profile's settings, then a ``--config`` file, then flags. What ``simulate``, ``sweep``, ``compare`` and
    ``tune`` run: a profile fitted under ``--num-scheduler-steps 10`` prices vLLM's steps as they ran there, and the same
    profile under other settings is another deployment (the public 640-prompt 8B run replayed on its calibrated profile
    at the simulator's own defaults: mean TTFT +55% and median TPOT -29% against vLLM's; at its settings, +11% and
    -6%).

    It prints one line naming the settings it took, and one naming those a ``--config`` file or a flag overrode.
    ``num_scheduler_steps`` > 1 is taken only where no run of the command speculates or chunks its prefills (vLLM 0.6
    ran multi-step scheduling without either) or serves disaggregated (not modelled with it); ``runs(base)``: the
    configs the command runs from ``base``, e.g. a sweep's cells; default ``base`` alone; otherwise a line says it was
    left at 1."""
    from policies.protocol import is_speculative
    from simulator.costs.profile_table import calibration_settings

    from simulator.fleet.fleet import resolve_profile

    data, given = config_data(args, **defaults)
    base = SimConfig.from_dict(data, source=args.config or "flags")
    profiles = [resolve_profile(p) for p in base.fleet.replica_profiles] or [base.cost.profile]
    records = [calibration_settings(p) for p in profiles]
    if any(r != records[0] for r in records):
        print("--replicas: its profiles were calibrated with different vLLM settings; none taken as defaults")
        return base
    recorded = records[0]
    current = base.flat()
    taken = {k: v for k, v in recorded.items() if k not in given and v != current[k]}
    overridden = {k: current[k] for k, v in recorded.items() if k in given and v != current[k]}
    steps = taken.pop("num_scheduler_steps", None)
    base = base.replace(**taken) if taken else base
    names = list(dict.fromkeys(Path(p).name for p in profiles))
    name = f"profile{'s' if len(names) > 1 else ''} {', '.join(names)}"
    if steps is not None:
        cells = list(runs(base) if runs is not None else [base])
        speculative = sorted({c.speculative.policy for c in cells if is_speculative(c.speculative.policy,
                                                                                     c.speculative.k)})
        why = f"speculates (--policy {', '.join(speculative)})" if speculative else \
            "chunks its prefills (--scheduler chunked-prefill)" if any(
                c.engine.scheduler == "chunked-prefill" for c in cells) else \
            "serves prefill and decode apart (--prefill-replicas, --decode-replicas; not modelled with it)" if any(
                c.fleet.disaggregated for c in cells) else None
        if why is not None:
            print(f"{name}: calibrated with --num-scheduler-steps {steps}, which vLLM 0.6 ran only without speculation "
                  f"and chunked prefill; this run {why}, so it keeps --num-scheduler-steps "
                  f"{base.engine.num_scheduler_steps}")
        else:
            base = base.replace(num_scheduler_steps=steps)
            taken["num_scheduler_steps"] = steps
    if taken:
        print(f"{name}: vLLM settings of the calibration, taken as defaults (a flag overrides them): "
              + ", ".join(flag_value(k, v) for k, v in taken.items()))
    if overridden:
        print(f"{name}: calibrated with " + ", ".join(flag_value(k, recorded[k]) for k in overridden) + "; "
              + ", ".join(flag_value(k, v) for k, v in overridden.items())
              + f" given override{'s it' if len(overridden) == 1 else ' them'}")
    return base


def config_data(args: argparse.Namespace, **defaults: Any) -> tuple[dict[str, Any], set[str]]:
    """The config fields ``args`` give, by name (:func:`config_from_args`'s order, field defaults left out), and the
    names a ``--config`` file or a flag set (what no other default may change)."""
    data: dict[str, Any] = dict(defaults)
    given: set[str] = set()
    if getattr(args, "config", None):
        path = Path(args.config)
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise UserError(f"--config {args.config}: cannot read a JSON config ({exc})") from None
        if not isinstance(data, dict):
            raise UserError(f"--config {args.config}: not a JSON object")
        from_file = flat_fields(data, args.config)  # by concern (or flat, as written before)
        data = {**defaults, **from_file}
        given.update(from_file)
    flags: dict[str, Any] = {}
    for name in FIELDS:
        value = getattr(args, name, None)
        if value is None:
            continue
        if name == "policy_params":
            value = parse_policy_params(value)
        elif name == "goodput_slo":
            value = parse_goodput(value)
        elif name == "replica_profiles" or (name == "replicas" and not value.strip().isdigit()):
            # --replicas A,B: a mixed fleet, one replica per profile (replicas follows from the list)
            entries = tuple(p.strip() for p in value.split(","))
            if not all(entries):
                raise UserError(f"{flags_of(name)[0]} {value}: an empty entry (a profile between two commas, or after "
                                "the last); give one profile per replica")
            flags["replica_profiles"] = entries
            continue
        elif not isinstance(value, bool):
            value = parse_field_value(name, value)
        flags[name] = value
    given.update(flags)
    data.update(align_proposer(flags, data))  # --speculative-method alone sets the proposer over a file's
    if getattr(args, "speculative_config", None) is not None:  # vLLM's --speculative-config JSON (engine_flags)
        data.update(align_proposer(speculative_config_fields(args.speculative_config, data, flags), data))
    _vllm_flags(args, data)
    if data.get("arrival") == "trace" and "rate" not in data:
        data["rate"] = None
    if data.get("trace") and "arrival" not in data:
        data["arrival"] = "trace"
    if data.get("acceptance_by_rank") and "acceptance" not in data:
        data["acceptance"] = "by-rank"
    if "k" not in data:  # a token tree's size is vLLM's num_speculative_tokens
        nodes = tree_nodes(data.get("speculative_token_tree"), data.get("speculative_num_draft_tokens"))
        if nodes is not None:
            data["k"] = nodes
    return data, given | (data.keys() - defaults.keys())


def _vllm_flags(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """``--burstiness``, ``--enable-chunked-prefill`` and ``--dataset-path`` (vLLM's flags for fields named otherwise
    here) into ``data``."""
    import math

    burstiness = getattr(args, "burstiness", None)
    if burstiness is not None:
        try:
            b = float(burstiness)
        except ValueError:
            raise UserError(f"--burstiness: not a number: {burstiness!r}") from None
        if not (math.isfinite(b) and b > 0):
            raise UserError(f"--burstiness: must be a finite number > 0, got {burstiness!r}")
        if getattr(args, "cv", None) is not None:
            raise UserError("--burstiness and --cv: give one (burstiness B is cv = 1/sqrt(B))")
        if b != 1.0 or data.get("arrival") == "gamma":
            data["arrival"], data["cv"] = "gamma", 1.0 / math.sqrt(b)
    if getattr(args, "enable_chunked_prefill", None):
        if getattr(args, "scheduler", None) not in (None, "chunked-prefill"):
            raise UserError(f"--enable-chunked-prefill and --scheduler {args.scheduler}: give one")
        data["scheduler"] = "chunked-prefill"
    dataset = getattr(args, "dataset_path", None)
    if getattr(args, "dataset_name", None) and not dataset:
        raise UserError("--dataset-name sharegpt: needs --dataset-path FILE.json")
    if dataset is not None:
        if getattr(args, "length_file", None) is not None:
            raise UserError("--dataset-path and --length-file: give one")
        data["length_dist"], data["length_file"] = "file", dataset


# -- commands ------------------------------------------------------------------------------------
def cmd_simulate(args: argparse.Namespace) -> int:
    from simulator.core.runner import table_format, write_result
    from simulator.fleet import run as run_config
    from simulator.results import prepare_out_dir, write_json

    config = calibrated_config(args)
    if args.save_timeline and not config.run.save_steps:
        config = config.replace(save_steps=True)  # the timeline draws the steps
    table_format(args.format)
    _, lock = prepare_out_dir(args.out, "run")  # before simulating: a bad folder is found now, not after a long run
    with lock:
        result = run_config(config)
        write_result(result, args.out, args.format)
        extra = []
        if args.save_result:
            from simulator.studies.vllm_io import vllm_result

            path = Path(args.out) / "vllm_result.json"
            write_json(path, vllm_result(result.summary, result.requests, config))
            extra.append(f"vLLM result: {path}")
        if args.save_timeline:
            from simulator.studies.timeline import write_timeline

            timeline = write_timeline(result.requests, result.steps, Path(args.out) / "timeline.json", result.replicas)
            extra.append(f"timeline: {timeline} (open in https://ui.perfetto.dev)")
    s = result.summary
    warn_ignored(s, config)
    print_summary(s, config)
    for line in extra:
        print(line)
    print(f"results in {args.out}/ (profile: {s['profile_method']})")
    return 0


def print_summary(s: dict[str, Any], config: SimConfig) -> None:
    """A run's figures, in vLLM's words and units where vLLM has them."""
    print(f"{s['requests']} requests, {s['steps']} steps, {s['simulated_seconds']:.1f} s simulated in "
          f"{s['wall_seconds']:.2f} s wall; workload: {s.get('workload', '?')}")
    print(f"request throughput {s['request_throughput']:.2f} req/s  output throughput {s['output_throughput']:.1f} "
          f"tokens/s  mean latency {s['mean_latency']:.3f} s  p99 {s['p99_latency']:.3f} s")
    print(f"{'':6}{'mean':>10}{'median':>10}{'p99':>10}{'std':>10}  (ms)")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL")):
        print(f"{label:6}" + "".join(f"{s.get(f'{st}_{name}_ms', float('nan')):10.2f}"
                                     for st in ("mean", "median", "p99", "std")))
    if s.get("request_goodput") is not None and "slo_attainment" in s:
        bounds = " ".join(f"{n}:{v:g}" for n, v in config.run.goodput_slo)
        print(f"goodput (vLLM: requests/s meeting {bounds} ms) {s['request_goodput']:.2f} req/s; "
              f"{s['slo_attainment']:.1%} of requests meet them")
    if s["proposed_tokens"]:
        print(f"measured draft acceptance rate (accepted / proposed tokens) {s['acceptance_rate']:.3f}; mean "
              f"acceptance length {s['mean_acceptance_length']:.2f} tokens per step (bonus included); input "
              f"{acceptance_input(config)}")
    warn_saturated(s)


def acceptance_input(config: SimConfig) -> str:
    """What the run's acceptance model was given, in words (only what that model reads)."""
    if config.speculative.acceptance == "constant":
        return f"token acceptance probability {config.speculative.acceptance_rate:g} (constant)"
    if config.speculative.acceptance == "beta":
        return (f"per-request acceptance Beta with mean {config.speculative.acceptance_rate:g} and concentration "
                f"{config.speculative.acceptance_concentration:g} (beta)")
    if config.speculative.acceptance == "position":
        positions = ",".join(f"{a:g}" for a in config.speculative.acceptance_positions)
        return f"acceptance by position {positions} (position)"
    if config.speculative.acceptance == "by-rank":
        return f"acceptance by depth and rank from {config.speculative.acceptance_by_rank} (by-rank)"
    return f"acceptance replayed from {config.speculative.acceptance_trace} (replay)"


def warn_ignored(summary: dict[str, Any], config: SimConfig) -> None:
    """One warning line on stderr when requests were ignored because they can never fit in the KV cache."""
    from simulator.studies.report import ignored_message

    message = ignored_message(summary, config.engine.block_size)
    if message:
        print(f"warning: {message}", file=sys.stderr)


def cmd_sweep(args: argparse.Namespace) -> int:
    from simulator.studies import report
    from simulator.studies.specs import axis_column
    from simulator.studies.sweep import (SWEEP_METRIC, TABLE_METRICS, build_cells, payoff_lines, print_table,
                                         sweep_and_plot)

    rates = parse_rates("--rates", args.rates)
    seeds = parse_seeds("--seeds", args.seeds)
    policies = parse_policy_list("--policies", args.policies)
    grid = parse_grid(args.grid or [])
    base = calibrated_config(args, lambda b: [c.config for c in build_cells(b, rates[:1], policies, seeds[:1], grid)],
                             rate=rates[0])
    out = Path(args.out)

    def finish(summary: Any, figures: list[str]) -> None:  # under the folder's lock, after the tables and figures
        report.write_report(
            out / report.REPORT_NAME, f"sweep: {_count(policies, 'policy', 'policies')} x {_count(rates, 'rate')} x "
            f"{_count(seeds, 'seed')}" + "".join(f" x {len(v)} {a}" for a, v in grid.items()),
            report.sweep_sections(summary, [axis_column(a) for a in grid], figures),
            report.sweep_warnings(summary, printed=printed), sweep_config(base, rates, policies, seeds, grid),
            sweep_profiles(base, grid))

    with report.recorded_warnings() as printed:
        summary, figures = sweep_and_plot(base, policies, rates, seeds, grid, args.out, args.workers, args.cluster,
                                          args.cluster_flag, args.quiet, finish)
    print_table(summary, axes=list(grid))
    payoffs = payoff_lines(summary, axes=list(grid))
    if payoffs:
        print(f"where each policy pays against no-spec, by {TABLE_METRICS[SWEEP_METRIC][0]}:")
        print("\n".join(f"  {line}" for line in payoffs))
    warn_sweep(summary)
    print(f"summary: {out / 'summary.csv'}")
    for f in figures:
        print(f"figure: {f}")
    print(f"report: {out / report.REPORT_NAME}")
    return 0


def _count(items: list[Any], one: str, many: str | None = None) -> str:
    return f"{len(items)} {one if len(items) == 1 else many or one + 's'}"


def sweep_config(base: SimConfig, rates: list[float], policies: list[str], seeds: list[int],
                 grid: dict[str, list[Any]]) -> dict[str, Any]:
    """What a sweep's report shows as its config: the swept values, then every other field of the base config."""
    swept = {"rate", "policy", "seed", *grid}
    return {"rates": rates, "policies": policies, "seeds": seeds, **({"grid": grid} if grid else {}),
            **{k: v for k, v in base.to_dict(flat=True).items() if k not in swept}}


def sweep_profiles(base: SimConfig, grid: dict[str, list[Any]] | None = None) -> list[dict[str, Any]]:
    """The profiles of a sweep's report (each of a ``--grid profile=...`` axis), and the policy's own when it believes
    in another one."""
    from simulator.studies.report import profile_info

    grid = grid or {}
    infos = [profile_info(str(p)) for p in grid.get("profile", [base.cost.profile])]
    for p in grid.get("policy_profile", [base.cost.policy_profile]):
        if p is not None and p != base.cost.profile:
            infos.append(profile_info(str(p), "policy profile"))
    return infos


def warn_sweep(summary: Any) -> None:
    """One line per warning a sweep's summary records (:func:`simulator.studies.report.summary_warnings`): the
    saturated cells (the ``saturated`` column), those that ignored requests. (The Python warnings its runs printed
    were said as the sweep ended, :func:`simulator.studies.sweep.sweep_and_plot`.)"""
    from simulator.studies.report import summary_warnings

    for message in summary_warnings(summary):
        print(f"warning: {message}", file=sys.stderr)


def cmd_plot(args: argparse.Namespace) -> int:
    from simulator.studies import plots

    out = Path(args.dir)
    path = out / "summary.csv"
    if not path.is_file():
        raise UserError(f"plot: {path} not found (run a sweep into {out} first)")
    summary = _read_result_csv(path, plots.SUMMARY_COLUMNS)
    steps_path = out / "steps_adaptive.csv"
    steps = _read_result_csv(steps_path, plots.STEPS_COLUMNS) if steps_path.is_file() else None
    _writable_dir(out)
    figures = [plots.plot_latency_vs_rate(summary, out / "latency_vs_rate.png")]
    if "no-spec" in set(summary["policy"]):
        figures.append(plots.plot_speedup(summary, out / "speedup.png"))
    if steps is not None:
        label = f"{steps['policy'].iloc[0]} at {steps['rate'].iloc[0]:g} req/s"
        figures.append(plots.plot_k_over_time(steps, out / "k_over_time.png", label))
    for f in figures:
        print(f"figure: {f}")
    return 0


def _writable_dir(out: Path) -> Path:
    from simulator.results import check_out_dir

    return check_out_dir(out, "plot")


def cmd_tune(args: argparse.Namespace) -> int:
    from simulator.results import write_csv
    from simulator.studies import report, tune
    from simulator.studies.sweep import build_cells, sweep_and_plot

    slo = parse_slo(args.slo)
    if not args.policy:
        raise UserError("tune: --policy is required (e.g. --policy goodput)")
    rates = parse_rates("--rates", args.rates)
    space = tune.search_space(args.param, args.policy)
    specs = tune.candidate_specs(args.policy, space)
    seeds = parse_seeds("--seeds", args.seeds)
    base = calibrated_config(args, lambda b: [c.config for c in build_cells(b, rates[:1], specs, seeds[:1])],
                             rate=rates[0])
    if slo.goodput_slo:
        if base.run.goodput_slo and base.run.goodput_slo != slo.goodput_slo:
            raise UserError("tune: --slo's per-request bounds and --goodput differ; give the bounds once, in --slo")
        base = base.replace(goodput_slo=slo.goodput_slo)
    out = Path(args.out)
    done: dict[str, Any] = {}

    def finish(summary: Any, figures: list[str]) -> None:  # under the folder's lock: tune.csv, figure, report
        table = tune.analyse(summary, slo)
        write_csv(out / "tune.csv", table)
        figure = tune.plot_tradeoff(table, slo, out / "tradeoff.png", summary, rates)
        verdict, warned = tune_verdict(table, slo, rates)
        report.write_report(
            out / report.REPORT_NAME, f"tune: {args.policy} for {slo} ({_count(specs, 'setting')} x "
            f"{_count(rates, 'rate')} x {_count(seeds, 'seed')})",
            [("Verdict", "\n".join(verdict)), ("Settings, best first (tune.csv)", table),
             ("Trade-off", Path(figure)), *report.sweep_sections(summary, [], figures)],
            warned + report.sweep_warnings(summary, printed=printed),
            {"slo": str(slo), "policy": args.policy, "search space": space,
             **sweep_config(base, rates, specs, seeds, {})},
            sweep_profiles(base))
        done.update(table=table, figure=figure, verdict=verdict, warned=warned)

    with report.recorded_warnings() as printed:
        summary, _ = sweep_and_plot(base, specs, rates, seeds, {}, args.out, args.workers, args.cluster,
                                    args.cluster_flag, args.quiet, finish, kind="tune")
    print(f"SLO {slo}: {len(specs)} settings x {len(rates)} rates x {len(seeds)} seeds")
    print(done["table"].head(10).to_string(index=False))
    for line in done["verdict"]:
        print(line)
    for message in done["warned"]:
        print(f"warning: {message}", file=sys.stderr)
    warn_sweep(summary)
    print(f"table: {out / 'tune.csv'}\nfigure: {done['figure']}\nreport: {out / report.REPORT_NAME}")
    return 0


def tune_verdict(table: Any, slo: Any, rates: list[float]) -> tuple[list[str], list[str]]:
    """What a tune concludes (lines for stdout) and its warnings: no setting meets the SLO anywhere, or every one
    meets it everywhere (the rates tried do not tell the settings apart)."""
    best = table.iloc[0]
    if best["sustainable_rate"] <= 0:
        return ([f"no setting meets the SLO even at {min(rates):g} req/s"],
                [f"the SLO is missed at every rate tried; try lower rates than {min(rates):g} req/s"])
    lines = [f"best: {best['policy']} meets {slo} up to {best['sustainable_rate']:g} req/s"]
    if bool(table["meets_slo_everywhere"].all()):
        return lines, [f"every setting meets the SLO at every rate tried (up to {max(rates):g} req/s): the "
                       "sustainable rate is at least that; raise --rates to find where they differ"]
    if bool(best["meets_slo_everywhere"]):
        lines.append(f"note: {best['policy']} meets the SLO at every rate tried; its limit lies above "
                     f"{max(rates):g} req/s")
    return lines, []


def cmd_compare(args: argparse.Namespace) -> int:
    """``compare A B``: two runs, two sweeps, or a run and a vLLM result side by side; ``compare RESULT.json``: replay a
    vLLM benchmark's workload in the simulator and print simulated against measured."""
    from simulator.studies import compare

    if len(args.inputs) == 1:
        source = Path(args.inputs[0])
        if not source.is_file():
            raise UserError(f"compare {source}: one input must be a vllm bench serve --save-result JSON file (to replay); "
                            "give two run or sweep folders to put them side by side")
        if not args.out:
            raise UserError("compare RESULT.json: --out DIR is required (the replayed run is written there)")
        base = calibrated_config(args, arrival="trace", trace="-")
        return compare.replay(source, base, args.out)
    if len(args.inputs) != 2:
        raise UserError(f"compare: give one vLLM result JSON, or two runs/sweeps; got {len(args.inputs)} inputs")
    return compare.side_by_side(args.inputs[0], args.inputs[1], args.out)


def cmd_demo(args: argparse.Namespace) -> int:
    from simulator.studies.demo import run_demo

    return run_demo(args.out, args.workers, args.quiet)


def cmd_disagg(args: argparse.Namespace) -> int:
    """``disagg``: goodput per GPU of disaggregated prefill/decode splits against co-located serving
    (:mod:`simulator.studies.disagg`)."""
    from simulator.results import prepare_out_dir
    from simulator.studies import disagg

    slo = parse_slo(args.slo)
    policies = parse_policy_list("--policies", args.policies)
    rates = parse_rates("--rates-per-gpu", args.rates_per_gpu)
    splits = disagg.parse_splits(disagg.DEFAULT_SPLITS if args.splits is None and args.gpus == disagg.DEFAULT_GPUS
                                 else args.splits)
    # a disaggregated base, so that the link's and the routers' flags apply; each cell sets its own layout
    base = config_from_args(args, arrival="trace", trace=disagg.DEFAULT_TRACE, profile=disagg.DEFAULT_PROFILE,
                            num_requests=disagg.DEFAULT_REQUESTS, prefill_replicas=1, decode_replicas=1)
    out, lock = prepare_out_dir(args.out, "disagg")
    with lock:
        _, table, figures = disagg.run_disagg_study(base, args.gpus, splits, policies, rates, slo, out, args.workers,
                                                    args.cluster)
    print(table.to_string(index=False))
    for line in disagg.verdict(table):
        print(line)
    print(f"tables: {out / 'cells.csv'}, {out / 'goodput.csv'}")
    for figure in figures:
        print(f"figure: {figure}")
    return 0


def cmd_advise(args: argparse.Namespace) -> int:
    """``advise``: the speculative configuration that meets an SLO, as engine flags (:mod:`simulator.studies.advise`,
    which reads its own flags; the config flags resolve here)."""
    from simulator.studies import advise_cli

    return advise_cli.command(args, config_from_args)


def cmd_bench(argv: list[str]) -> int:
    from simulator.studies.bench import main as bench_main

    return bench_main(argv)


def resolve_cluster(args: argparse.Namespace) -> None:
    """Give the Dask scheduler's address one meaning: ``--cluster ADDRESS``. ``--scheduler ADDRESS`` (an address
    such as ``tcp://HOST:8786``, never one of the engine's scheduling modes, which keep their names) is the old
    spelling of it, kept as an alias: it moves to ``args.cluster`` and ``args.scheduler`` keeps only scheduling
    modes. ``args.cluster_flag`` names the flag that gave the address, for messages."""
    if not hasattr(args, "cluster"):
        return
    args.cluster_flag = "--cluster"
    scheduler = getattr(args, "scheduler", None)
    if scheduler is not None and "://" in scheduler:
        if args.cluster is not None and args.cluster != scheduler:
            raise UserError(f"--scheduler {scheduler} and --cluster {args.cluster}: two different Dask schedulers; "
                            "give one")
        args.cluster, args.cluster_flag, args.scheduler = scheduler, "--scheduler", None


def _add_run_flags(parser: argparse.ArgumentParser, out_default: str | None = None, cluster: bool = False) -> None:
    """``--out``, ``--workers``, ``--quiet``; and ``--cluster`` when the command can run on a Dask cluster."""
    from simulator.studies.executors import default_workers

    parser.add_argument("--out", required=out_default is None, default=out_default, metavar="DIR",
                        help="output folder, created if missing (results, tables, figures)" + (f" (default {out_default})" if out_default else " (required)"))
    parser.add_argument("--workers", type=int, default=default_workers(), metavar="N",
                        help=f"local worker processes (default {default_workers()}: the usable cores)")
    if cluster:
        parser.add_argument("--cluster", metavar="tcp://HOST:PORT",
                            help="run the cells on this Dask distributed scheduler instead of local workers "
                                 "(the dist extra; workers need specsim and the input files at the same paths); "
                                 "--scheduler tcp://HOST:PORT is an old alias of it")
    parser.add_argument("--quiet", action="store_true", help="no progress output (default: a progress bar on a terminal)")


#: Every command, with its one-line help (the top-level help lists them all; profile, calibrate, validate and bench parse their own
#: flags: ``run_sim.py COMMAND --help``).
COMMANDS = {
    "simulate": "run one simulation: requests.csv, summary.json, config.json (vLLM-style TTFT/TPOT/ITL/E2EL in ms)",
    "sweep": "latency versus rate for several policies and seeds, in parallel: summary.csv and figures",
    "plot": "redraw a sweep's figures from its summary.csv",
    "tune": "search a policy's parameters for an SLO over a range of rates",
    "compare": "two runs or sweeps side by side, or a vLLM benchmark result replayed and compared (table and figure)",
    "demo": "the default demo (what no arguments runs): where speculation stops paying",
    "bench": "the simulator's own speed: simulated requests per wall-second and peak memory",
    "disagg": "goodput per GPU at TTFT and TPOT SLOs: disaggregated prefill/decode splits against co-located serving",
    "advise": "the speculative configuration that meets an SLO (highest rate, or fewest GPUs), as vllm serve and SGLang "
              "flags",
    "profile": "measure a model pair's costs on a device (profile extra; torch)",
    "calibrate": "fit a cost model of a vLLM deployment to its vllm bench serve --save-result files: a profile",
    "validate": "real engine against the simulator on the same requests (profile extra; torch)",
}

EPILOG = """examples:
  python run_sim.py simulate --request-rate 4 --num-prompts 200 --policy fixed-k --num-speculative-tokens 3 --out results/run1
  python run_sim.py sweep --rates 1,2,4 --policies no-spec,fixed-k:3,goodput --num-requests 200 --out results/sweep
  python run_sim.py COMMAND --help   for the flags of a command (meaning, unit, allowed values, default)
A user error ends with one line naming the input, and exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = FlagParser(prog="run_sim.py", description="specsim: simulate LLM serving with speculative decoding "
                                                    "(no command: the demo)",
                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    sim = sub.add_parser("simulate", help=COMMANDS["simulate"], description=COMMANDS["simulate"])
    add_config_flags(sim)
    add_speculative_config_flag(sim)
    sim.add_argument("--out", required=True, metavar="DIR", help="output folder (created; a rerun replaces its files)")
    sim.add_argument("--format", choices=("auto", "csv", "parquet"), default="auto",
                     help="per-request (and per-step) tables: parquet, csv, or auto = parquet when pyarrow is "
                          "importable (default auto)")
    sim.add_argument("--save-result", action="store_true",
                     help="also write DIR/vllm_result.json in vllm bench serve --save-result's schema (vLLM users' "
                          "scripts read it; see docs/metrics.md)")
    sim.add_argument("--save-timeline", action="store_true",
                     help="also write DIR/timeline.json, Chrome/Perfetto trace events: the batch track (each step's "
                          "kind, k, batch size, tokens) and one span per request; implies --save-steps")
    sim.set_defaults(func=cmd_simulate)

    sweep = sub.add_parser("sweep", help=COMMANDS["sweep"], description=COMMANDS["sweep"])
    add_config_flags(sweep)
    add_speculative_config_flag(sweep)
    sweep.add_argument("--rates", required=True, metavar="R1,R2,...",
                       help="request rates to sweep, comma-separated, req/s > 0 (required)")
    sweep.add_argument("--policies", default="no-spec,fixed-k:1,fixed-k:3,fixed-k:5,goodput", metavar="SPEC,...",
                       help="policy specs NAME[:K][/PARAM=VALUE...], comma-separated (default "
                            "no-spec,fixed-k:1,fixed-k:3,fixed-k:5,goodput)")
    sweep.add_argument("--seeds", default="0", metavar="S1,S2,...",
                       help="seeds, comma-separated integers >= 0; figures show the spread over them (default 0)")
    sweep.add_argument("--grid", action="append", metavar="FIELD=V1,V2",
                       help="another sweep axis: any config field and its values; repeatable")
    _add_run_flags(sweep, cluster=True)
    sweep.set_defaults(func=cmd_sweep)

    plot = sub.add_parser("plot", help=COMMANDS["plot"], description=COMMANDS["plot"])
    plot.add_argument("dir", help="the sweep's output folder (holding summary.csv)")
    plot.set_defaults(func=cmd_plot)

    tune = sub.add_parser("tune", help=COMMANDS["tune"], description=COMMANDS["tune"])
    add_config_flags(tune)
    tune.add_argument("--slo", required=True,
                      help='the objective (required): METRIC<=VALUE on a summary figure, e.g. "p99_latency<=20" '
                           '(seconds) or "p99_ttft_ms<=500" (ms); or per-request attainment "P%% METRIC:MS ...", e.g. '
                           '"99%% ttft:500 tpot:50": at least 99%% of requests meet every bound (vLLM\'s --goodput '
                           'pairs, ms)')
    tune.add_argument("--rates", required=True, metavar="R1,R2,...",
                      help="request rates, comma-separated, req/s > 0 (required)")
    tune.add_argument("--seeds", default="0", metavar="S1,S2,...", help="seeds, comma-separated integers >= 0 "
                                                                       "(default 0)")
    tune.add_argument("--param", action="append", metavar="NAME=V1,V2",
                      help="a policy parameter's candidate values (k is the bound K_max); repeatable (default: the "
                           "policy's search space, e.g. goodput k=2,4,6 bonus=1.0,1.1,1.3)")
    _add_run_flags(tune, cluster=True)
    tune.set_defaults(func=cmd_tune)

    compare = sub.add_parser("compare", help=COMMANDS["compare"], description=COMMANDS["compare"] + (
        ". A or B: a simulate folder (summary.json), a sweep folder (summary.csv) or a vLLM result JSON. With one vLLM "
        "result JSON: its workload (successful requests' lengths in order; arrivals as recorded, else drawn at its "
        "request_rate and burstiness; its max_concurrency) is simulated "
        "with the config flags given, and simulated is printed against measured per metric."))
    compare.add_argument("inputs", nargs="+", metavar="A [B]", help="two runs or sweeps, or one vLLM result JSON")
    compare.add_argument("--out", metavar="DIR", help="where the table, figure (and a replayed run) go "
                                                     "(required to replay; optional for two inputs)")
    add_config_flags(compare)
    compare.set_defaults(func=cmd_compare)

    demo = sub.add_parser("demo", help=COMMANDS["demo"], description=COMMANDS["demo"])
    _add_run_flags(demo, out_default="results/demo")
    demo.set_defaults(func=cmd_demo)

    from simulator.studies import disagg  # its defaults (pandas and the fleet are imported only when it runs)

    split = sub.add_parser("disagg", help=COMMANDS["disagg"], description=COMMANDS["disagg"] + (
        " (Splitwise's and DistServe's headline; simulator/studies/disagg.py). Default: the Azure conversation trace "
        "on the vLLM-calibrated Llama 3.1 8B / 3.2 1B H100 profile; the config flags set the rest (--kv-link, "
        "--prefill-router and --decode-router for the disaggregated layouts; --prefill-router also routes the "
        "co-located replicas)."))
    add_config_flags(split)
    split.add_argument("--gpus", type=int, default=disagg.DEFAULT_GPUS, metavar="G",
                       help=f"GPUs of every layout: G/tp co-located replicas, or P + D instances of tp GPUs (tp: the "
                            f"profile's tensor parallel; default {disagg.DEFAULT_GPUS})")
    split.add_argument("--splits", metavar="P:D,...",
                       help=f"prefill:decode instance counts, each using every GPU (default: {disagg.DEFAULT_SPLITS} "
                            f"with {disagg.DEFAULT_GPUS} GPUs, every split with another count; empty: every split)")
    split.add_argument("--rates-per-gpu", default=disagg.DEFAULT_RATES_PER_GPU, metavar="R1,R2,...",
                       help=f"request rates per GPU to run, req/s > 0 (default {disagg.DEFAULT_RATES_PER_GPU})")
    split.add_argument("--policies", default=disagg.DEFAULT_POLICIES, metavar="SPEC,...",
                       help=f"speculation policies (on the decode instances of a split), comma-separated (default "
                            f"{disagg.DEFAULT_POLICIES})")
    split.add_argument("--slo", default=disagg.DEFAULT_SLO, metavar='"P% ttft:MS tpot:MS"',
                       help=f'the SLO: at least P%% of requests meet every bound, ms (default '
                            f'"{disagg.DEFAULT_SLO.replace("%", "%%")}"); the request count defaults to '
                            f'{disagg.DEFAULT_REQUESTS} (--num-requests)')
    _add_run_flags(split, out_default="results/disagg", cluster=True)
    split.set_defaults(func=cmd_disagg)
    _add_advise_parser(sub)
    for name in ("bench", "profile", "calibrate", "validate"):  # listed here; they parse their own flags (run_sim.py NAME --help)
        sub.add_parser(name, help=COMMANDS[name] + f" (run_sim.py {name} --help)", add_help=False)
    return parser


def _add_advise_parser(sub: Any) -> None:
    """``advise``: the config flags (the workload, the engine's settings; ``--profile`` and ``--max-concurrency`` take
    comma lists here), its own (:func:`simulator.studies.advise_cli.add_flags`), ``--out``, ``--workers``, ``--cluster``."""
    from simulator.studies import advise_cli

    parser = sub.add_parser("advise", help=COMMANDS["advise"], description=COMMANDS["advise"] + (
        " (simulator/studies/advise.py; docs/advise.md). --profile takes P1,P2,... (one per drafter of one target and "
        "GPU) and --max-concurrency C1,C2,... (closed loops to try); --acceptance-trace takes [METHOD=]FILE."))
    add_config_flags(parser)
    advise_cli.add_flags(parser)
    _add_run_flags(parser, out_default="results/advise", cluster=True)
    parser.set_defaults(func=cmd_advise)


#: Commands that parse their own flags: name -> handler(argv).
PASSTHROUGH: dict[str, Callable[[list[str]], int]] = {"bench": cmd_bench}


def run_command(command: Callable[[], int]) -> int:
    """Run ``command`` as the command line does: a :class:`UserError` prints one line and gives exit status 2,
    Ctrl-C gives 130, a reader of stdout that went away (``| head``) ends it quietly with 1; an
    :class:`~policies.errors.InputWarning` prints as one line (:func:`~policies.errors.one_line_warnings`)."""
    one_line_warnings()
    try:
        code = command()
        sys.stdout.flush()  # a broken pipe shows here, not in the interpreter's last flush
        return code
    except BrokenPipeError:  # Python's idiom: what is still buffered for stdout goes to devnull, not to a traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except OSError as exc:  # a file the user named that cannot be read or written: one line, not a traceback
        if exc.filename is None:
            raise
        print(f"error: {exc.filename}: {exc.strerror or exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def main(argv: list[str] | None = None, calibrate: Callable[..., list[str]] | None = None) -> int:
    """The simulator's commands (``run_sim.py`` adds ``profile`` and ``validate`` from the profiles side, and gives
    ``calibrate``, the profiles side's calibration that ``advise --vllm-results`` runs first)."""
    argv = sys.argv[1:] if argv is None else argv
    return run_command(lambda: _dispatch(argv, calibrate))


def _dispatch(argv: list[str], calibrate: Callable[..., list[str]] | None = None) -> int:
    if argv and argv[0] in PASSTHROUGH:
        return PASSTHROUGH[argv[0]](argv[1:])
    args = build_parser().parse_args(argv or ["demo"])
    args.calibrate = calibrate
    resolve_cluster(args)
    return args.func(args)
