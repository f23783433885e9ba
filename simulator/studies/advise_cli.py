"""``run_sim.py advise``'s flags and the command (:mod:`simulator.studies.advise` holds the study): read without the
study's imports, so that building the command line stays light."""
from __future__ import annotations

import math
import sys
from typing import Any, Callable

from policies.errors import UserError
from simulator.config import SimConfig
from simulator.studies.advise_inputs import DEFAULT_KS, DEFAULT_TREES, FAMILIES

# -- the command line ------------------------------------------------------------------------------------------
#: Config fields advise chooses (or sets per load): giving one is refused, naming the flag to use instead.
CHOSEN = {"policy": "the candidates", "k": "--ks", "policy_params": "the candidates", "policy_file": "the candidates",
          "proposer": "--methods", "speculative_method": "--methods", "speculative_token_tree": "--trees",
          "speculative_num_steps": "--trees", "speculative_eagle_topk": "--trees",
          "speculative_num_draft_tokens": "--trees", "acceptance": "--acceptance-length",
          "acceptance_rate": "--acceptance-length", "acceptance_positions": "--acceptance-length",
          "ngram_match_prob": "--acceptance-length ngram=AL@K", "rate": "--rates or --target-rate",
          "replicas": "--target-rate", "replica_profiles": "--profile", "prefill_replicas": "--target-rate",
          "decode_replicas": "--target-rate", "duration": "--num-requests", "trace_speedup": "--rates",
          "acceptance_by_rank": "the default rank model for trees", "acceptance_ranks": "the default rank model "
          "for trees"}


def add_flags(parser: Any) -> None:
    """``advise``'s own flags (the command line adds the config flags, ``--out``, ``--workers`` and ``--cluster``)."""
    group = parser.add_argument_group("advise (the deployment, the traffic, the SLO, the candidates)")
    group.add_argument("--slo", required=True, metavar='"P% ttft:MS tpot:MS"',
                       help='the SLO (required), tune\'s syntax: "99%% ttft:500 tpot:50" (at least 99%% of requests '
                            'meet every bound, ms) or METRIC<=VALUE on a summary figure, e.g. "p99_ttft_ms<=500"')
    group.add_argument("--rates", metavar="R1,R2,...", help="request rates to try, req/s (default: 0.05 to 1.2 x no "
                       "speculation's throughput at full load); --max-concurrency C1,C2,... tries closed loops instead")
    group.add_argument("--target-rate", type=float, metavar="R", help="answer the fewest GPUs (co-located replicas "
                       "or a prefill:decode split) that serve R req/s within the SLO, and the configuration")
    group.add_argument("--engine", choices=("vllm", "sglang"), help="the engine the answer is for (default: the "
                       "profiles', else vllm); candidates it cannot deploy are ranked, not recommended")
    group.add_argument("--acceptance-length", action="append", metavar="METHOD=AL[@K]",
                       help="a measured mean acceptance length (accepted + 1 per draft, vLLM's) at K speculative "
                            "tokens (default K 3), e.g. eagle3=3.1@3; repeatable")
    group.add_argument("--acceptance-results", action="append", metavar="METHOD=FILE",
                       help="a vllm bench serve --save-result file of a run with speculation on: its spec_decode "
                            "counters give METHOD's acceptance; repeatable")
    group.add_argument("--acceptance-dataset", default="sharegpt", metavar="NAME",
                       help="whose published acceptance to default to: sharegpt, cnn_dailymail, gsm8k, "
                            "instructcoder (SpecDecode-Bench) or mtbench (vLLM #20780) (default sharegpt)")
    group.add_argument("--methods", metavar="M1,M2", help="drafters to consider, vLLM's method names (default: every "
                       "one a profile prices, and ngram)")
    group.add_argument("--families", default=",".join(FAMILIES), metavar="F1,F2",
                       help=f"candidate families (default {','.join(FAMILIES)})")
    group.add_argument("--ks", default=",".join(map(str, DEFAULT_KS)), metavar="K1,K2",
                       help="fixed k to try (default 1..7)")
    group.add_argument("--trees", default=",".join("/".join(map(str, t)) for t in DEFAULT_TREES),
                       metavar="S/T/N,...", help="token trees for heads, SGLang's num_steps/eagle_topk/"
                                                 "num_draft_tokens (default 5/4/8,3/4/6,6/8/16)")
    group.add_argument("--search", choices=("halving", "exhaustive"), default="halving",
                       help="successive halving on short workloads first (default), or every candidate on the whole")
    group.add_argument("--no-discover", action="store_true", help="price only the --profile files (default: also "
                       "the other drafters' profiles of the same deployment beside them and in profiles/data)")
    group.add_argument("--ramp-requests", type=int, default=600, metavar="N",
                       help="requests of the diurnal ramp the generated tables run on (default 600)")
    cal = parser.add_argument_group("a deployment given as vLLM results (calibrated first, as run_sim.py calibrate)")
    cal.add_argument("--vllm-results", nargs="+", metavar="FILE",
                     help="vllm bench serve --save-result files of runs without speculation; the engine flags "
                          "(--max-num-seqs, ...) are the settings they ran with")
    cal.add_argument("--gpu", help="their GPU (as calibrate's --gpu)")
    cal.add_argument("--target", help="the served model's config (as calibrate's --target)")
    cal.add_argument("--tp", type=int, default=1, help="their tensor-parallel degree (default 1)")
    cal.add_argument("--drafts", default="llama-3.2-1b", metavar="D1,D2",
                     help="drafters to price, model or head configs (default llama-3.2-1b)")
    cal.add_argument("--calibrate-max-evals", type=int, default=100, metavar="N",
                     help="simulations of the file set per fit (default 100)")


def _list(flag: str, text: str | None, cast: Callable[[str], Any]) -> list[Any]:
    items = [x.strip() for x in (text or "").split(",") if x.strip()]
    try:
        return [cast(x) for x in items]
    except ValueError:
        raise UserError(f"{flag}: cannot read {text!r}") from None


def request_from_args(args: Any, profiles: list[str]) -> Any:
    """The :class:`Request` of the parsed command line (``args.max_concurrency`` and ``args.acceptance_trace``
    already taken off as lists, :func:`command`)."""
    from simulator.studies import advise_inputs
    from simulator.studies.advise import Load, Request
    from simulator.studies.specs import parse_rates, parse_slo

    slo = parse_slo(args.slo)
    load = None
    if args.rates:
        load = Load("rate", tuple(sorted(parse_rates("--rates", args.rates))))
    if args.concurrency:
        if load is not None:
            raise UserError("--rates and --max-concurrency: give one load axis")
        load = Load("concurrency", tuple(sorted(float(c) for c in args.concurrency)))
    if args.target_rate is not None:
        if not (math.isfinite(args.target_rate) and args.target_rate > 0):
            raise UserError(f"--target-rate: a rate > 0 req/s, got {args.target_rate:g}")
        if load is not None and load.kind != "rate":
            raise UserError("--target-rate: needs request rates, not --max-concurrency (a client's closed loop in "
                            "front of a fleet is not modelled)")
    families = tuple(_list("--families", args.families, str))
    for f in families:
        if f not in FAMILIES:
            raise UserError(f"--families: unknown family {f!r} (one of {', '.join(FAMILIES)})")
    ks = tuple(_list("--ks", args.ks, int))
    if not ks or any(not 1 <= k <= 64 for k in ks):
        raise UserError(f"--ks: whole numbers in [1, 64], got {args.ks!r}")
    trees = tuple(tuple(_list("--trees", t.replace("/", ","), int)) for t in _list("--trees", args.trees, str))
    if any(len(t) != 3 for t in trees):
        raise UserError(f"--trees: S/T/N triples (num_steps/eagle_topk/num_draft_tokens), got {args.trees!r}")
    if args.ramp_requests < 10:
        raise UserError(f"--ramp-requests: at least 10, got {args.ramp_requests}")
    methods = None
    if args.methods:
        from policies.draft_head import method_name

        methods = tuple(method_name(m, "--methods") for m in _list("--methods", args.methods, str))
    single = advise_inputs.identity(profiles[0]).method if len(profiles) == 1 and args.no_discover else None
    inputs = advise_inputs.parse_acceptance_flags(args.acceptance_length, args.acceptance_results,
                                                  args.acceptance_traces, args.acceptance_dataset, single)
    return Request(profiles, slo, load, args.target_rate, args.engine, inputs, families, methods, ks, trees,
                   args.search == "exhaustive", not args.no_discover, args.ramp_requests, args.workers,
                   args.cluster, getattr(args, "cluster_flag", "--cluster"), args.quiet)


def command(args: Any, config_from_args: Callable[..., SimConfig]) -> int:
    """``run_sim.py advise``: the flags read (the multi-valued ``--profile``, ``--max-concurrency`` and
    ``--acceptance-trace`` taken off first), the study run into ``--out``, the answer printed."""
    from simulator.results import prepare_out_dir
    from simulator.studies.advise import advise, print_advice

    for name, instead in CHOSEN.items():
        if getattr(args, name, None) not in (None, False):
            from simulator.config import flag

            raise UserError(f"advise: {flag(name)}: advise chooses it (use {instead})")
    profiles = _list("--profile", args.profile, str)
    args.concurrency = _list("--max-concurrency", args.max_concurrency, int)
    args.acceptance_traces = _list("--acceptance-trace", args.acceptance_trace, str)
    args.profile = args.max_concurrency = args.acceptance_trace = None
    out, lock = prepare_out_dir(args.out, "advise")
    with lock:
        if args.vllm_results:
            if profiles:
                raise UserError("--vllm-results and --profile: give the deployment once")
            if args.calibrate is None:
                raise UserError("--vllm-results: calibrating needs run_sim.py (the profiles side)")
            if not (args.gpu and args.target):
                raise UserError("--vllm-results: needs --gpu and --target (as calibrate)")
            settings_base = config_from_args(args, rate=1.0, num_requests=1)
            profiles = args.calibrate(args.vllm_results, args.gpu, args.target, args.tp,
                                      _list("--drafts", args.drafts, str), settings_base, out / "calibrated",
                                      args.calibrate_max_evals, lambda line: print(line, file=sys.stderr))
            args.no_discover = True
        if not profiles:
            raise UserError("advise: give --profile P1[,P2,...] (one per drafter of one deployment) or "
                            "--vllm-results FILES")
        request = request_from_args(args, profiles)
        base = config_from_args(args, profile=profiles[0], rate=1.0, num_requests=400)
        if request.slo.goodput_slo and base.run.goodput_slo and base.run.goodput_slo != request.slo.goodput_slo:
            raise UserError("advise: --slo's per-request bounds and --goodput differ; give the bounds once, in --slo")
        if base.workload.arrival == "trace" and request.load is not None and request.load.kind != "rate":
            raise UserError("--max-concurrency with --trace: a trace is replayed at --rates")
        log = (lambda _: None) if request.quiet else (lambda line: print(line, file=sys.stderr))
        advice, ranked = advise(base, request, out, log)
    print_advice(advice, ranked)
    return 0
