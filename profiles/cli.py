"""``python run_sim.py profile ...``: measure a profile, or report how well the cost model fits one.

Measure (needs torch and transformers)::

    run_sim.py profile --target llama-2-7b --draft llama-68m --device cuda --dtype bf16 \\
        --batch-sizes 1,2,4 --query-lens 1,2,3,4,5 --context-lens 128,512 --prefill-lens 128,512 \\
        --out profiles/data/h200__llama-2-7b__llama-68m.csv --max-seconds 600

Report (no torch needed)::

    run_sim.py profile --report PROFILE.csv [--plot fit.png]

Profile the real serving engine's own passes (:mod:`profiles.engine_profile`; CPU, float32)::

    run_sim.py profile --engine --pair smollm2 --out profiles/data/cpu__smollm2-135m__smollm2-draft.csv

Measure the acceptance of the real pair on the shipped prompts (:mod:`profiles.acceptance`), and by depth and rank
for token trees, of the draft model or the EAGLE head::

    run_sim.py profile --acceptance --pair smollm2 --k 5 --out profiles/data/acceptance__smollm2.csv
    run_sim.py profile --acceptance --pair smollm2 --speculative-method eagle --k 5 \\
        --out profiles/data/acceptance__smollm2-eagle.csv \\
        --acceptance-by-rank profiles/data/acceptance_by_rank__smollm2-eagle.csv

Bad input raises :class:`UserError` (one line; exit status 2).
"""
from __future__ import annotations

import argparse
import sys

import pandas as pd

from profiles.grid import GPU_GRID, Grid
from profiles.profiler import ProfileSettings, TimingPolicy, run_profile
from policies.errors import FlagParser, UserError, exit_on_user_error

FITTERS = ("linear", "interp")


def _ints(flag: str, text: str, allow_empty: bool = False) -> tuple[int, ...]:
    """``"1,2,4"`` -> (1, 2, 4); ``"none"`` -> () where ``allow_empty``."""
    if allow_empty and text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise UserError(f"{flag}: expected comma-separated integers (got {text!r})") from None


def _csv(values: tuple[int, ...]) -> str:
    return ",".join(map(str, values))


def build_parser() -> FlagParser:
    p = FlagParser(prog="run_sim.py profile", description=__doc__.splitlines()[0])
    p.add_argument("--report", metavar="PROFILE", help="print the cost model's held-out fit of this profile")
    p.add_argument("--plot", metavar="PNG", help="with --report: plot measured vs fitted seconds")
    p.add_argument("--target", help="target model: a shipped name (profiles/models) or a config.json path")
    p.add_argument("--draft", help="draft model (optional): a shipped name or a config.json path; or a draft head's "
                                   "config (eagle3-llama-3.1-8b, eagle-llama-3.1-8b, mtp: random weights, eager "
                                   "forward), its rows the draft's")
    p.add_argument("--out", help="profile CSV to write (its metadata goes beside it, <stem>.meta.json)")
    p.add_argument("--batch-sizes", help=f"sequences per pass (default {_csv(GPU_GRID.batch_sizes)})")
    p.add_argument("--query-lens", help=f"target verify tokens per sequence, k+1 (default {_csv(GPU_GRID.query_lens)})")
    p.add_argument("--draft-query-lens", help="draft decode tokens per sequence: 1, and more for the catch-up pass "
                   "after a wholly accepted proposal or steps without speculation (default 1; --engine: 1,2,3)")
    p.add_argument("--context-lens", help=f"cached tokens per sequence (default {_csv(GPU_GRID.context_lens)})")
    p.add_argument("--prefill-lens", help=f"prompt lengths, 'none': no prefill (default {_csv(GPU_GRID.prefill_lens)})")
    p.add_argument("--max-prefill-tokens", type=int,
                   help=f"leave out prefill points with batch x prompt above this many tokens "
                        f"(default {GPU_GRID.max_prefill_tokens})")
    p.add_argument("--dtype", default="bf16", help="bf16, fp16 or fp32")
    p.add_argument("--forward", default="eager", choices=("eager", "optimized"),
                   help="forward path timed: eager (Hugging Face as is, DynamicCache) or optimized (preallocated KV "
                        "cache written in place, attention over the live part, CUDA graphs on a GPU); default eager")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="optimized forward without CUDA graphs (the kernels launched one by one)")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto (cuda when present)")
    p.add_argument("--threads", type=int, help="CPU threads (torch.set_num_threads)")
    p.add_argument("--max-seconds", type=float, help="stop measuring after this many seconds (keeps what was done)")
    p.add_argument("--num-layers", type=int, help="cut both models to this many layers")
    p.add_argument("--scale-layers", metavar="N1,N2",
                   help="measure the target at N1 and N2 layers, extrapolate to its full depth")
    p.add_argument("--check-scaling", action="store_true",
                   help="with --scale-layers: measure the full depth too and report the extrapolation's error")
    p.add_argument("--weights", metavar="DIR", help="real weights: DIR/<model name>/ (from_pretrained) when present")
    p.add_argument("--max-memory-gb", type=float, help="use at most this much memory (GiB, weights included)")
    p.add_argument("--warmup", type=int, help=f"untimed passes per point (default {TimingPolicy.warmup})")
    p.add_argument("--min-repeats", type=int,
                   help=f"timed passes per point, at least (default {TimingPolicy.min_repeats})")
    p.add_argument("--max-repeats", type=int,
                   help=f"timed passes per point, at most (default {TimingPolicy.max_repeats})")
    p.add_argument("--rel-tol", type=float, help="stop repeating when the running median moves less than this "
                   f"(relative; default {TimingPolicy.rel_tol})")
    p.add_argument("--point-seconds", type=float,
                   help=f"stop repeating a point after this many timed seconds (default {TimingPolicy.point_seconds})")
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights, caches and tokens")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    real = p.add_argument_group("the real engine (--engine, --acceptance)")
    real.add_argument("--engine", action="store_true", help="profile the real engine's passes (grid flags apply; "
                      "default grid: the CPU validation grid)")
    real.add_argument("--acceptance", action="store_true", help="measure the pair's acceptance on the shipped prompts")
    real.add_argument("--pair", default="smollm2", help="models: smollm2 (SmolLM2-135M-Instruct + its draft), tiny, "
                                                        "or TARGET+DRAFT model configs with random weights (--engine; "
                                                        "--device, --dtype and --forward apply)")
    real.add_argument("--draft-path", help="folder of the draft (default: profiles/data/smollm2-draft) or, with "
                                           "--speculative-method eagle, of the head (default "
                                           "profiles/data/smollm2-eagle)")
    real.add_argument("--speculative-method", default="draft_model",
                      help="--acceptance: who drafts, vLLM's method name: draft_model (the pair's draft model) or "
                           "eagle (its EAGLE head, profiles/train_head.py); default draft_model")
    real.add_argument("--acceptance-by-rank", metavar="FILE",
                      help="--acceptance: also write the acceptance by depth and rank (CSV depth,rank,probability: "
                           "the probability that the target's token at depth d is the drafter's rank-r candidate "
                           "given the path above was accepted; greedy, depths 1..--k, ranks 0..--topk - 1), which the "
                           "simulator's --acceptance-by-rank reads")
    real.add_argument("--topk", type=int, default=4,
                      help="--acceptance-by-rank: candidates measured per depth (ranks 0..topk-1; default 4)")
    real.add_argument("--prefill-batch-sizes", help="--engine: prefill batch sizes (default 1,2,4,8)")
    real.add_argument("--rounds", type=int, default=9, help="--engine: passes over the whole grid")
    real.add_argument("--spread", type=float, default=0.5,
                      help="--engine: decode batches hold sequences of lengths c (1 -+ spread)")
    real.add_argument("--k", type=int, default=5, help="--acceptance: tokens proposed per step")
    real.add_argument("--output-len", type=int, default=64, help="--acceptance: output tokens per prompt")
    real.add_argument("--max-num-seqs", type=int, default=8, help="--acceptance: running requests at most")
    real.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sampling")
    return p


def main(argv: list[str]) -> int:
    """Run the ``profile`` command; returns the exit status (user errors raise :class:`UserError`)."""
    args = build_parser().parse_args(argv)
    if args.engine or args.acceptance:
        return real_engine(args)
    if args.report:
        return report(args.report, args.plot)
    if args.plot:
        raise UserError("--plot: only with --report PROFILE")
    if not args.target or not args.out:
        raise UserError("profile: needs --target CONFIG and --out PATH (or --report PROFILE)")
    settings = settings_from_args(args)
    result = run_profile(settings)
    meta = result.meta
    state = "complete" if meta["complete"] else f"incomplete ({meta['stopped'] or 'points left'})"
    print(f"{result.path}: {meta['points']['rows']} rows, {meta['points']['skipped']} skipped, {state}, "
          f"{meta['wall_seconds']} s on {meta['device']}")
    check = meta.get("layer_scaling", {}).get("check")
    if check:
        print(scaling_table(check))
    return 0


def real_engine(args: argparse.Namespace) -> int:
    """``--engine`` (profile the engine's passes) or ``--acceptance`` (measure acceptance) on ``--pair``."""
    if args.engine and args.acceptance:
        raise UserError("profile: --engine and --acceptance are separate runs; give one")
    if not args.out:
        raise UserError(f"profile {'--engine' if args.engine else '--acceptance'}: needs --out PATH")
    try:
        import torch
    except ImportError as exc:
        raise UserError(f"profile: the real engine needs the profile extra (pip install -e '.[profile]'): "
                        f"{exc}") from None
    from profiles.models.pairs import load_pair

    from profiles.models import forward

    kind = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    device = forward.setup_device(kind, args.threads or 1)
    from policies.draft_head import method_name

    args.speculative_method = method_name(args.speculative_method, "--speculative-method")  # SGLang's names too
    pair = load_pair(args.pair, args.draft_path, device=device,
                     dtype=args.dtype if device.type == "cuda" or "+" in args.pair else "fp32",
                     method=args.speculative_method if args.acceptance else "draft_model")
    if args.acceptance:
        from profiles.acceptance import fit_report, measure_acceptance, write_trace

        result = measure_acceptance(pair, args.k, args.output_len, args.max_num_seqs, args.temperature, args.seed,
                                    args.speculative_method)
        write_trace(result, args.out)
        print(fit_report(args.out))
        if args.acceptance_by_rank:
            from profiles.acceptance import measure_rank_acceptance, rank_report, write_rank_table

            table, reached = measure_rank_acceptance(pair, args.speculative_method, args.k, args.topk, args.output_len)
            write_rank_table(table, args.acceptance_by_rank)
            print(rank_report(table, reached, args.acceptance_by_rank))
        return 0
    from profiles.engine_profile import (CPU_GRID, CPU_PREFILL_BATCH_SIZES, CPU_TIMING, EngineProfileSettings,
                                         profile_engine)

    prefill_batches = CPU_PREFILL_BATCH_SIZES if args.prefill_batch_sizes is None else \
        _ints("--prefill-batch-sizes", args.prefill_batch_sizes)
    frame = profile_engine(pair, EngineProfileSettings(
        out=args.out, grid=_grid(args, CPU_GRID), prefill_batch_sizes=prefill_batches, timing=_timing(args, CPU_TIMING),
        rounds=args.rounds, spread=args.spread, temperature=args.temperature, threads=args.threads or 1,
        seed=args.seed, forward=args.forward, cuda_graphs=args.cuda_graphs))
    print(f"{args.out}: {len(frame)} rows of the {args.pair} engine's passes")
    return 0


def _grid(args: argparse.Namespace, default: Grid) -> Grid:
    """The grid of the flags, each flag not given taken from ``default``."""
    def axis(flag: str, value: str | None, fallback: tuple[int, ...], allow_empty: bool = False) -> tuple[int, ...]:
        return fallback if value is None else _ints(flag, value, allow_empty)

    return Grid(batch_sizes=axis("--batch-sizes", args.batch_sizes, default.batch_sizes),
                query_lens=axis("--query-lens", args.query_lens, default.query_lens),
                context_lens=axis("--context-lens", args.context_lens, default.context_lens),
                prefill_lens=axis("--prefill-lens", args.prefill_lens, default.prefill_lens, allow_empty=True),
                max_prefill_tokens=default.max_prefill_tokens if args.max_prefill_tokens is None
                else args.max_prefill_tokens,
                draft_query_lens=axis("--draft-query-lens", args.draft_query_lens, default.draft_query_lens))


def _timing(args: argparse.Namespace, default: TimingPolicy) -> TimingPolicy:
    """The timing policy of the flags, each flag not given taken from ``default``."""
    names = ("warmup", "min_repeats", "max_repeats", "rel_tol", "point_seconds")
    return TimingPolicy(**{n: getattr(default, n) if getattr(args, n) is None else getattr(args, n) for n in names})


def settings_from_args(args: argparse.Namespace) -> ProfileSettings:
    """Validated profiling settings from parsed flags (``--device auto``: cuda when torch sees one)."""
    scale = None
    if args.scale_layers:
        scale = _ints("--scale-layers", args.scale_layers)
        if len(scale) != 2:
            raise UserError(f"--scale-layers: expected N1,N2 (got {args.scale_layers!r})")
    try:
        import torch
        import transformers  # noqa: F401 - checked here, used by the profiler
    except ImportError as exc:
        raise UserError(f"profile: measuring needs the profile extra (pip install -e '.[profile]'): {exc}") from None
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    grid = _grid(args, GPU_GRID)
    timing = _timing(args, TimingPolicy())
    return ProfileSettings(target=args.target, draft=args.draft, out=args.out, grid=grid, dtype=args.dtype,
                           forward=args.forward, cuda_graphs=args.cuda_graphs,
                           device=device, threads=args.threads, max_seconds=args.max_seconds,
                           num_layers=args.num_layers, scale_layers=scale, check_scaling=args.check_scaling,
                           weights=args.weights, max_memory_gb=args.max_memory_gb, timing=timing, seed=args.seed,
                           quiet=args.quiet)


def scaling_table(check: dict) -> str:
    """The layer-scaling check as a small table: relative error of the extrapolation per role/phase."""
    frame = pd.DataFrame.from_dict(check, orient="index")
    return "layer-scaling check (extrapolated vs measured full depth):\n" + frame.to_string(
        formatters={"mean_rel_error": "{:.1%}".format, "max_rel_error": "{:.1%}".format})


def report(path: str, plot: str | None = None) -> int:
    """Print both fitters' held-out error on the profile at ``path``; optionally plot measured vs fitted."""
    from simulator.costs.cost_model import fit_report
    from simulator.costs.profile_table import read_profile

    table = read_profile(path)
    frames = [fit_report(table, fitter).assign(fitter=fitter) for fitter in FITTERS]
    out = pd.concat(frames, ignore_index=True)[["fitter", "role", "phase", "n_train", "n_test",
                                               "mean_rel_error", "max_rel_error"]]
    print(f"{path} ({table.method}, {table.meta.get('device', 'unknown device')}): held-out fit, 20% of each "
          "role/phase left out")
    print(out.to_string(index=False, formatters={"mean_rel_error": "{:.1%}".format,
                                                 "max_rel_error": "{:.1%}".format}))
    if plot:
        plot_fit(table, plot)
        print(f"plot: {plot}")
    return 0


def plot_fit(table, path: str) -> None:
    """Profile vs fitted seconds (each fitter fitted on all rows), one panel per fitter, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from simulator.costs.cost_model import fit_cost_model, predict_row
    from simulator.studies.plots import plain_log_ticks

    frame = table.frame
    fig, axes = plt.subplots(1, len(FITTERS), figsize=(5 * len(FITTERS), 4.5), squeeze=False)
    for ax, fitter in zip(axes[0], FITTERS):
        model = fit_cost_model(table, fitter)
        for (role, phase), part in frame.groupby(["role", "phase"]):
            fitted = [predict_row(model, role, phase, int(r.batch_size), int(r.query_len), int(r.context_len))
                      for r in part.itertuples()]
            ax.scatter(part["seconds"], fitted, s=8, label=f"{role} {phase}")
        lo, hi = frame["seconds"].min(), frame["seconds"].max()
        ax.plot([lo, hi], [lo, hi], color="grey", lw=1)
        ax.set(xlabel=f"{table.method} seconds", ylabel="fitted seconds", title=f"{fitter} (fitted on all rows)")
        plain_log_ticks(ax, "both")
        ax.legend(fontsize=7)
    fig.suptitle(f"{table.path} ({table.method})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
