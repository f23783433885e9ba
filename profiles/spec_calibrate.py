"""Speculative costs of one engine fitted to that engine's own speculative runs, and the runs reproduced.

``run_sim.py calibrate --published TABLE ...``: fits the parameters below to published tables of one engine
(:mod:`profiles.published`), writes a profile per target and drafter, and prints every published point beside the
simulated one (``--reproduce``: the same table from the written profiles, without fitting).

Why: a calibration to serving runs without speculation (:mod:`profiles.calibrate`, vLLM ~0.6) prices a speculative
step by extrapolation: its verification of B (k + 1) tokens by a constant compute efficiency, its drafter's passes by
the target's per-pass overhead. Against SpecDecode-Bench's vLLM 0.10 runs (``profiles/data/specdecode_bench``) that
lands close for EAGLE-3 on Llama-3.1-8B and far off for a draft model on a 70B target. Here every part of a speculative
step is one term of the step formula (:mod:`policies.step_time`), priced by the roofline (:mod:`profiles.analytical`)
with the engine's own efficiencies and overheads (:class:`SpecCalibration`), and those numbers are fitted to the
engine's speculative runs:

- verification: one target pass over B (n + 1) tokens (a chain's n = k, a tree's nodes), its matrix multiplications at
  a compute efficiency that grows with the tokens of the pass, eff(T) = ``compute`` T / (T + ``compute_half_tokens``)
  (:func:`profiles.analytical.matmul_seconds`: partly filled tiles and waves of a GEMM of few rows), its attention of
  n + 1 queries over each sequence's cache read once (multi-query: vLLM V1 and SGLang);
- the drafter's passes at batch, each paying the drafter's own per-pass overhead (``head_pass_s``: an EAGLE head drafts
  inside the engine step on the device, CUDA graphs in vLLM V1; ``draft_pass_s + draft_pass_per_layer_s x layers``: a
  draft model's passes, whose launches grow with its layers), the first of a step fed by the engine's rule
  (:func:`policies.protocol.draft_feed`: vLLM 0.10 the accepted tokens and the bonus; vLLM >= 0.11 and SGLang 0.5
  every verified token, padded);
- the host work of a step (``step_s + step_per_seq_s x B``: scheduling, input preparation, output processing) and
  what speculation adds to it (``spec_s``: the rejection sampler and the proposer's bookkeeping, fixed;
  ``ngram_per_seq_s x B``: vLLM V1's n-gram lookup, on the CPU, per sequence): the profile's ``overhead`` and
  ``spec_overhead`` rows.

The runs are SpecDecode-Bench's offline batches of B identical prompts (:mod:`simulator.studies.offline_copies`),
priced through the profile written from the parameters. Acceptance: Llama-3.1-8B's n-gram runs replay the recorded
per-step acceptance of each prompt (``specdecode_bench/acceptance_trace__*``; the steps without a match verify one
token); a run whose acceptance length the source states uses it; the others (EAGLE and EAGLE-3, draft models,
Llama-3-70B, Qwen3-8B) have theirs inferred from the batch-1 speedup (that point is then "fitted: acceptance length";
the recorded EAGLE stream is shipped but disagrees with the figure's batch-1 speed-ups, :meth:`Bench.trace_name`),
and an n-gram run of another target its match share from the largest fitted batch too ("fitted: match share": the 8B's
recorded share is no measurement of another model's outputs); their other batches test the costs. A run of measured
acceptance has its batch-1 point held out. The fit: least squares (scipy's ``least_squares``, ``trf``, bounded:
efficiencies in (0, 1], seconds >= 0) of the speedups at the fitted batch sizes (``--fit-batches``, default 1, 64 and
128; 16 held out; ``--hold-out-methods`` leaves a method's curves out but for their acceptance), Fig. 4's batch-1 step
shares and n-gram drafting shares, and the single-request TPOT without speculation of vLLM issue #20780, all the
engine's setups at once (the parameters are the engine's, shared by its models; the drafter overheads by drafter kind).
It runs on a vectorised twin of the profile's pricing (:class:`Twin`: the same roofline and terms, evaluated at the
exact contexts instead of interpolated on the profile's grid; the two agree to 0.005 in speedup, tested); the shipped
numbers and the reproduction table come from the profiles, through the simulator's cost model. A parameter the runs
drive to its bound (0) is recorded as 0: that part is not seen.
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from policies.errors import UserError
from policies.tree import TreeShape, rank_table
from profiles.analytical import DATA_DIR, GPUS, Architecture, Deployment, Efficiency, analytical_profile, pass_cost
from profiles.grid import Grid, powers_of_two
from profiles.published import Tree, config_name, read_published
from simulator.config import DEFAULT_ACCEPTANCE_RANKS
from simulator.costs.cost_model import CostModel, fit_cost_model
from simulator.costs.profile_table import ProfileTable, meta_path, write_profile
from simulator.studies import offline_copies as oc

BENCH_DIR = DATA_DIR / "specdecode_bench"
#: The shipped published tables of each engine (``calibrate --published`` defaults) and Fig. 4's breakdown.
PUBLISHED = {"vllm": (BENCH_DIR / "fig1_speedup.csv", DATA_DIR / "vllm_eagle" / "h100__llama-3.1-8b__bs1_mtbench.csv"),
             "sglang": (BENCH_DIR / "fig2_sglang.csv",)}
BREAKDOWN = BENCH_DIR / "fig4_breakdown.csv"
REPO = DATA_DIR.parents[1]


def meta_file(path: str) -> Path:
    """A profile's metadata file, given the profile's CSV or the metadata file itself."""
    return meta_path(path) if path.lower().endswith(".csv") else Path(path)


def shown(path: str | Path) -> str:
    """A path as a profile's metadata records it: relative to the repository where it lies inside it."""
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)
#: Datasets of SpecDecode-Bench whose prompts the experiment replays.
DATASETS = ("cnn_dailymail", "gsm8k", "instructcoder", "sharegpt")
#: Context tokens of a single-request TPOT row (vLLM issue #20780: MT-Bench, a prompt of about 170 tokens with its
#: chat template and answers of up to 256; as :data:`profiles.calibrate.CONTEXT_LEN`).
TPOT_CONTEXT = 300
#: The rank table an SGLang tree's nodes are chosen by (top-1 acceptance 0.7, the simulator's default rank spread):
#: only its shape (nodes per depth) enters the costs.
TREE_RANKS = rank_table((0.7,), DEFAULT_ACCEPTANCE_RANKS)


# -- the parameters -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecCalibration:
    """An engine's speculative cost parameters (module docstring); fractions of datasheet peaks, and seconds. Each
    field's ``metadata`` says what identifies it."""

    compute: float = field(default=0.6, metadata={"unit": "fraction of peak FLOP/s", "identified by": (
        "the fall of speedup with batch (verification of B (k + 1) tokens turns compute-bound) and the prefill's share "
        "of a batch of long prompts")})
    compute_half_tokens: float = field(default=64.0, metadata={
        "unit": "tokens of a pass at which its matrix multiplications reach half of compute",
        "identified by": "how speedup falls between batch 16 and 128 (verification of 64 to 512 tokens)"})
    roofline_exponent: float = field(default=0.0, metadata={
        "unit": "p of the smooth roofline (c^p + m^p)^(1/p) (0: max(c, m))",
        "identified by": "the speedups at batch 64 beside 1 and 128 (verification of 256 tokens: the ridge point)"})
    bandwidth: float = field(default=0.85, metadata={"unit": "fraction of peak HBM bytes/s", "identified by": (
        "the single-request TPOT without speculation (vLLM #20780) and Fig. 4's batch-1 verification share")})
    pass_overhead_s: float = field(default=0.5e-3, metadata={"unit": "s per target pass", "identified by": (
        "the single-request TPOT beside the roofline's kernels")})
    step_s: float = field(default=0.8e-3, metadata={"unit": "s per step", "identified by": (
        "Fig. 4's batch-1 share of sampling and other overhead")})
    step_per_seq_s: float = field(default=5e-6, metadata={"unit": "s per step and sequence", "identified by": (
        "the speedups at batch 128 (per-sequence work of every step, which speculation divides among more tokens)")})
    spec_s: float = field(default=0.1e-3, metadata={"unit": "s per speculative step", "identified by": (
        "vLLM: Fig. 4's batch-1 sampling and overhead with speculation against without; SGLang: its chains' batch-1 "
        "speedups beside vLLM's at the same acceptance")})
    spec_per_seq_s: float = field(default=5e-6, metadata={"unit": "s per speculative step and sequence",
                                                          "identified by": "SGLang: the speedups' fall with batch"})
    ngram_per_seq_s: float = field(default=2e-6, metadata={"unit": "s per step and sequence (n-gram lookup)",
                                                           "identified by": "the n-gram curves' fall with batch"})
    head_pass_s: float = field(default=0.3e-3, metadata={"unit": "s per draft-head pass", "identified by": (
        "Fig. 4's batch-1 drafting share of EAGLE and EAGLE-3")})
    draft_pass_s: float = field(default=0.2e-3, metadata={"unit": "s per draft-model pass", "identified by": (
        "Fig. 4's batch-1 drafting share of the two draft models (16 and 28 layers)")})
    draft_pass_per_layer_s: float = field(default=40e-6, metadata={"unit": "s per draft-model pass and layer",
                                                                   "identified by": "as draft_pass_s"})

    def efficiency(self) -> Efficiency:
        """The roofline's efficiencies and the target's per-pass overhead."""
        return replace(Efficiency(), compute=self.compute, bandwidth=self.bandwidth,
                       compute_half_tokens=self.compute_half_tokens, roofline_exponent=self.roofline_exponent,
                       overhead_fixed_s=self.pass_overhead_s,
                       overhead_per_layer_s=0.0)

    def draft_efficiency(self, draft: Architecture) -> Efficiency:
        """:meth:`efficiency` with the drafter's own per-pass overhead: a head's, or a draft model's by its layers."""
        if draft.head is not None:
            return replace(self.efficiency(), overhead_fixed_s=self.head_pass_s)
        return replace(self.efficiency(), overhead_fixed_s=self.draft_pass_s,
                       overhead_per_layer_s=self.draft_pass_per_layer_s)

    def spec_seconds(self, batch: Any, ngram: bool) -> Any:
        """Seconds a speculative step of ``batch`` sequences adds beyond its passes (the ``spec_overhead`` rows)."""
        return self.spec_s + self.spec_per_seq_s * batch + (self.ngram_per_seq_s * batch if ngram else 0.0 * batch)

    def record(self) -> dict[str, dict[str, Any]]:
        """Each parameter's value, unit and what identifies it (a profile's metadata)."""
        return {f.name: {"value": getattr(self, f.name), **f.metadata} for f in fields(self)}


# -- what was run -------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Setup:
    """One engine deployment and speculative method of a published table (every batch size and dataset)."""

    engine: str
    version: str
    gpu: str
    tp: int
    model: str
    """The target as the source names it."""
    target: str
    """Its shipped config (:data:`profiles.published.CONFIGS`)."""
    method: str
    drafter: str
    draft: str | None
    """The drafter's shipped config (a head or a draft model); None for n-gram and none."""
    k: int
    tree: Tree | None

    @property
    def draft_extend(self) -> str:
        """What the drafter's first pass of a step feeds (:data:`policies.protocol.DRAFT_EXTENDS`): vLLM before 0.11
        the accepted tokens and the bonus (``vllm/v1/spec_decode/eagle.py`` 0.10, ``prepare_inputs``), its draft model
        as SpecDecode-Bench ran it too (``disable_padded_drafter_batch=True``); vLLM 0.11 on every verified token
        (its padded drafter batch, the default); SGLang 0.5 likewise (its draft-extend CUDA graph of
        ``speculative_num_steps + 1`` tokens a request)."""
        if self.engine == "sglang":
            return "padded"
        return "padded" if _version(self.version) >= (0, 11) and self.method != "draft_model" else "accepted"

    @property
    def drafts(self) -> bool:
        """Whether a model drafts (a head or a draft model: passes to price)."""
        return self.draft is not None

    def shape(self) -> TreeShape:
        """The verified tree of a speculative step: a chain of k, or SGLang's tree (its ``num_draft_tokens`` the
        caption's k + 1: the root counted)."""
        if self.tree is None:
            return TreeShape.chain(self.k)
        return TreeShape.sglang(self.tree.steps, self.tree.topk, self.k + 1, TREE_RANKS)

    def deployment(self) -> Deployment:
        """The roofline's deployment: the target sharded ``tp`` ways, the drafter with it (vLLM V1, SGLang)."""
        return Deployment(self.gpu, self.target, self.draft or self.target, self.tp, draft_tp=self.tp)

    @property
    def label(self) -> str:
        tree = f" {self.tree}" if self.tree else ""
        return f"{self.engine} {self.version} {self.model} {self.method}{tree} (k={self.k})"


def _version(text: str) -> tuple[int, int]:
    """(major, minor) of a version string's leading numbers; (0, 0) when it has none."""
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return (parts[0], parts[1]) if len(parts) == 2 else (0, 0)


def setup_of(row: dict[str, Any], where: str) -> Setup:
    """The :class:`Setup` of a published row."""
    if row["gpu"] not in GPUS:
        raise UserError(f"{where}: gpu must be one of {', '.join(GPUS)} (got {row['gpu']!r})")
    speculative = row["method"] in ("eagle", "eagle3", "draft_model")
    return Setup(row["engine"], row["engine_version"], row["gpu"], row["tp"], row["model"],
                 config_name(row["model"], f"{where}: model"), row["method"], row["drafter"],
                 config_name(row["drafter"], f"{where}: drafter") if speculative else None,
                 row["num_speculative_tokens"], row["tree"])


# -- SpecDecode-Bench's prompts and recorded acceptance -----------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    """A dataset's prompts of SpecDecode-Bench as the experiment replays them: the requests of the recorded traces
    (``specdecode_bench/README.md``: a subsample chosen to keep the pooled acceptance of the full set), with their
    prompt and output lengths of Llama-3.1-8B-Instruct's runs (the other targets' outputs were not published: the
    8B's lengths stand in for theirs)."""

    dataset: str
    prompts: oc.Prompts
    """Prompt tokens and the greedy output tokens (the n-gram run's: speculation is lossless)."""
    eagle_outputs: np.ndarray
    """Output tokens of the EAGLE run (its recorded stream covers them)."""
    streams: dict[str, list[tuple[np.ndarray, np.ndarray]]]
    """``eagle``, ``ngram`` (k = 3) and ``ngram_k5``: each prompt's recorded (proposed, accepted) per step."""

    @classmethod
    def load(cls, dataset: str, directory: Path = BENCH_DIR) -> "Bench":
        lengths = pd.read_csv(directory / "request_lengths__llama-3.1-8b.csv")
        lengths = lengths[lengths["dataset"] == dataset].set_index("request_id")
        traces = {name: pd.read_csv(path) for name in ("eagle", "ngram", "ngram_k5")
                  if (path := directory / f"acceptance_trace__llama-3.1-8b__{dataset}__{name}.csv").is_file()}
        order = list(traces["eagle"]["request_id"].drop_duplicates())  # every trace of a dataset has its requests
        streams = {}
        for name, trace in traces.items():
            steps = {rid: (g["proposed"].to_numpy(np.int64), g["accepted"].to_numpy(np.int64))
                     for rid, g in trace.groupby("request_id", sort=False)}
            streams[name] = [steps[rid] for rid in order]
        rows = lengths.loc[order]
        prompts = oc.Prompts(rows["prompt_tokens"].to_numpy(np.int64), rows["output_tokens"].to_numpy(np.int64))
        return cls(dataset, prompts, rows["eagle_run_output_tokens"].to_numpy(np.int64), streams)

    def match(self, k: int) -> float:
        """Share of the recorded n-gram steps (k = 3 or 5) whose lookup found a match (proposed tokens)."""
        steps = np.concatenate([p for p, _ in self.streams["ngram" if k == 3 else "ngram_k5"]])
        return float((steps > 0).mean())

    def trace_name(self, setup: Setup) -> str | None:
        """The recorded stream that describes ``setup``'s acceptance on this dataset: Llama-3.1-8B's n-gram runs; None
        for the rest. The recorded EAGLE stream (``acc_eagle``; which of the figure's runs it recorded, EAGLE-1 or
        another, the source does not say) is shipped but not replayed here: its acceptance length and the figure's
        batch-1 speed-ups disagree by up to 17% (CNN/DailyMail: 2.34 recorded, 2.00 implied), more than the costs
        could account for at batch 1, where the single-request TPOT pins them; that curve's acceptance is inferred
        from its batch-1 speed-up, as every other method's (``docs/trust.md``)."""
        if setup.target != "llama-3.1-8b" or setup.engine != "vllm" or setup.tree is not None:
            return None
        name = {"ngram": "ngram" if setup.k == 3 else "ngram_k5"}.get(setup.method)
        return name if name in self.streams else None


# -- the speed twin of a profile's pricing ------------------------------------------------------------------------
@functools.cache
def architectures(target: str, draft: str | None) -> tuple[Architecture, Architecture | None]:
    """The target's and the drafter's architectures (read once)."""
    arch = Architecture.from_config(target, "--target")
    return arch, Architecture.from_config(draft, "--draft", arch) if draft is not None else None


class Twin:
    """A setup's steps and prefills priced by the terms its profile holds (:func:`spec_profile`), vectorised over steps
    at their exact contexts: the fit's pricing (thousands of steps a candidate, where the profile's path prices one
    step in tens of microseconds). Equal to the profile's path at the profile's grid nodes; between them, the profile
    interpolates (tested: the speedups agree to 0.005)."""

    def __init__(self, setup: Setup, cal: SpecCalibration) -> None:
        self.setup, self.cal, self.gpu, self.tp = setup, cal, GPUS[setup.gpu], setup.tp
        self.target, self.draft = architectures(setup.target, setup.draft)
        self.eff = cal.efficiency()
        self.draft_eff = cal.draft_efficiency(self.draft) if self.draft is not None else None
        self.tree = setup.shape() if setup.method != "none" else None
        self.ngram = setup.method == "ngram"

    def steps(self, batch: int, steps: oc.Steps) -> np.ndarray:
        """Seconds of each lockstep step of ``batch`` copies (the step formula's terms, :mod:`policies.step_time`)."""
        context = steps.context.astype(float)
        spec = steps.proposed > 0
        nodes = self.tree.num_nodes if self.setup.tree is not None else steps.proposed
        verify = pass_cost(self.target, self.gpu, "decode", batch, np.where(spec, nodes + 1, 1), context,
                           tp=self.tp, eff=self.eff).seconds
        cal = self.cal
        host = cal.step_s + cal.step_per_seq_s * batch + np.where(spec, cal.spec_seconds(batch, self.ngram), 0.0)
        return verify + host + np.where(spec, self.drafting(batch, context, steps.feed), 0.0)

    def drafting(self, batch: int, context: np.ndarray, feed: np.ndarray) -> np.ndarray:
        """Seconds of a step's draft passes (0 without a drafter): the first fed ``feed`` tokens a sequence, each later
        one the nodes its tree expands (a chain: one), over the context and the tokens fed before it."""
        if self.draft is None:
            return np.zeros_like(context)
        draft = lambda q, c: pass_cost(self.draft, self.gpu, "decode", batch, q, c, tp=self.tp, eff=self.draft_eff,
                                       all_logits=False).seconds
        seconds = draft(feed, context + 1 - feed)
        for fed, before in zip(self.tree.expanded[1:], self.tree.fed_before[1:]):
            seconds = seconds + draft(fed, context + before)
        return seconds

    def prefill(self, batch: int, prompt_tokens: np.ndarray) -> np.ndarray:
        """Each prompt's prefill seconds (:func:`simulator.studies.offline_copies.prefill_seconds`' chunks)."""
        total = batch * prompt_tokens
        count = -(-total // oc.CHUNK_TOKENS)
        prompt = np.repeat(np.arange(len(prompt_tokens)), count)
        start = (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count)) * oc.CHUNK_TOKENS
        tokens = np.minimum(oc.CHUNK_TOKENS, total[prompt] - start)
        length = prompt_tokens[prompt]
        copies = (start + tokens - 1) // length - start // length + 1
        seconds = self.cal.step_s + self.cal.step_per_seq_s * copies + pass_cost(
            self.target, self.gpu, "prefill", copies, tokens / copies, 0, tp=self.tp, eff=self.eff).seconds
        if self.draft is not None:
            seconds = seconds + pass_cost(self.draft, self.gpu, "prefill", copies, tokens / copies, 0, tp=self.tp,
                                          eff=self.draft_eff).seconds
        return np.bincount(prompt, seconds, minlength=len(prompt_tokens))

    def prompt_seconds(self, batch: int, prompts: oc.Prompts, steps: oc.Steps) -> np.ndarray:
        """Each prompt's time: its prefill and its weighted steps (as :func:`simulator.studies.offline_copies.
        prompt_seconds`)."""
        decode = np.bincount(steps.prompt, steps.weight * self.steps(batch, steps), minlength=len(prompts))
        return self.prefill(batch, prompts.prompt_tokens) + decode

    def parts(self, batch: int, steps: oc.Steps) -> dict[str, float]:
        """Seconds of the weighted steps by Fig. 4's parts: verification (the target pass), drafting (the drafter's
        passes; an n-gram lookup's host seconds), and the rest (sampling and other overhead)."""
        context, spec = steps.context.astype(float), steps.proposed > 0
        nodes = self.tree.num_nodes if self.setup.tree is not None else steps.proposed
        verify = pass_cost(self.target, self.gpu, "decode", batch, np.where(spec, nodes + 1, 1), context,
                           tp=self.tp, eff=self.eff).seconds
        cal = self.cal
        lookup = cal.ngram_per_seq_s * batch if self.ngram else 0.0
        drafting = np.where(spec, self.drafting(batch, context, steps.feed) + lookup, 0.0)
        rest = cal.step_s + cal.step_per_seq_s * batch + np.where(spec, cal.spec_s + cal.spec_per_seq_s * batch, 0.0)
        w = steps.weight
        return {"verification": float(np.sum(w * verify)), "drafting": float(np.sum(w * drafting)),
                "rest": float(np.sum(w * rest))}


# -- the published curves -----------------------------------------------------------------------------------------
@dataclass
class Curve:
    """A setup's published speedups on one dataset, by batch size (SpecDecode-Bench's offline batches)."""

    setup: Setup
    dataset: str
    points: dict[int, tuple[float, str]]
    """Batch size -> (published speedup, where: file and line)."""
    trace: str | None
    """The recorded acceptance stream the experiment replays (:meth:`Bench.trace_name`), or None: inferred."""
    acceptance: dict[str, float] = field(default_factory=dict)
    """The acceptance of expected steps: ``acceptance_length`` (bonus included) and, for n-gram, ``match`` (the share of
    steps whose lookup found a match): inferred, or a given length (:attr:`given`); empty for a replayed stream."""
    given: str = ""
    """Where the acceptance length comes from when it is not inferred here: ``published`` (the source states it), or
    the profile of another engine's calibration whose same target, drafter, k and dataset gave it
    (``--acceptance-from``: acceptance is the drafter's, not the engine's); empty: inferred or replayed."""
    held_out: bool = False
    """Whether the costs' fit leaves the whole curve out (``--hold-out-methods``): only the points that give its
    acceptance are fitted (:meth:`inferred_at`), its other points test the costs fitted to the other methods."""

    @property
    def known(self) -> bool:
        """Whether the acceptance is known beforehand (a replayed stream, or a given length): the batch-1 point then
        tests the costs."""
        return self.trace is not None or bool(self.given)

    @property
    def unknowns(self) -> tuple[str, ...]:
        """What the fit infers of this curve's acceptance: nothing for a replayed stream or a published length; the
        acceptance length from the batch-1 speedup; an n-gram's match share too, from the largest batch's (how often a
        step verifies k + 1 tokens decides how it scales; the 8B's recorded share is no measurement of another
        target's outputs)."""
        if self.known:
            return ()
        return ("acceptance_length", "match") if self.setup.method == "ngram" else ("acceptance_length",)

    def steps(self, bench: Bench, acceptance: dict[str, float] | None = None) -> tuple[oc.Steps, np.ndarray]:
        """The lockstep steps of the curve's speculative runs and their output lengths (:mod:`simulator.studies.
        offline_copies`): the recorded stream's, or the expected steps of the inferred ``acceptance`` (default:
        :attr:`acceptance`)."""
        setup, shape = self.setup, self.setup.shape()
        if self.trace is not None:
            outputs = bench.eagle_outputs if self.trace == "eagle" else bench.prompts.output_tokens
            prompts = oc.Prompts(bench.prompts.prompt_tokens, outputs)
            return oc.trace_steps(prompts, bench.streams[self.trace], setup.draft_extend), outputs
        known = self.acceptance if acceptance is None else acceptance
        return oc.expected_steps(bench.prompts, known["acceptance_length"], shape.num_nodes, setup.draft_extend,
                                 known.get("match", 1.0), shape.depth), bench.prompts.output_tokens

    def bounds(self, unknown: str) -> tuple[float, float]:
        """The range an inferred acceptance figure may take: a length 1 to the tree's depth + 1; a share in (0, 1]."""
        return (1.0, self.setup.shape().depth + 1.0) if unknown == "acceptance_length" else (0.01, 1.0)

    def inferred_at(self, batch: int, fit_batches: Sequence[int]) -> str | None:
        """What this point is fitted for, if it is the acceptance's: batch 1 the acceptance length, an n-gram's largest
        fitted batch its match share."""
        if "acceptance_length" in self.unknowns and batch == 1:
            return "acceptance_length"
        if "match" in self.unknowns and batch == max(b for b in fit_batches if b in self.points):
            return "match"
        return None

    def fits(self, batch: int, fit_batches: Sequence[int]) -> bool:
        """Whether the fit sees the point: a batch of ``fit_batches``, except a measured acceptance's batch 1 (it tests
        the costs) and, of a held-out curve, every point but its acceptance's."""
        if self.held_out:
            return self.inferred_at(batch, fit_batches) is not None
        return batch in fit_batches and not (self.known and batch == 1)



def curves_of(rows: list[dict[str, Any]], path: str, benches: dict[str, Bench]) -> list[Curve]:
    """The offline-copies speedup rows of a published table as curves (other rows are left to :func:`tpots_of`)."""
    curves: dict[tuple, Curve] = {}
    for row in rows:
        if row["batch_kind"] != "offline_copies" or row["figure"] != "speedup":
            continue
        where = f"{path}: line {row['line']}"
        if row["dataset"] not in benches:
            raise UserError(f"{where}: dataset {row['dataset']!r}: the offline experiment replays SpecDecode-Bench's "
                            f"prompts of {', '.join(DATASETS)}")
        setup = setup_of(row, where)
        key = (setup, row["dataset"])
        if key not in curves:
            trace = benches[row["dataset"]].trace_name(setup)
            curves[key] = Curve(setup, row["dataset"], {}, trace)
        curve = curves[key]
        batch = int(row["batch_value"])
        if batch in curve.points:
            raise UserError(f"{where}: batch {batch} of {setup.label} on {row['dataset']} is given twice")
        curve.points[batch] = (row["value"], where)
        length = row["acceptance_length"]
        if length is not None and curve.trace is None:
            if curve.given and curve.acceptance["acceptance_length"] != length:
                raise UserError(f"{where}: acceptance_length {length} differs from the curve's other rows "
                                f"({curve.acceptance['acceptance_length']}): one run, one acceptance")
            curve.acceptance, curve.given = {"acceptance_length": length}, "published"
    return list(curves.values())


def borrow_acceptance(curves: list[Curve], profiles: Sequence[str]) -> None:
    """Give each chain curve of inferred acceptance the acceptance length that another engine's speculative calibration
    (a profile written by this module) inferred for the same target, drafter, k and dataset: greedy decoding with the
    same drafter accepts alike in any engine, so the length is the drafter's, measured by the other engine's runs (its
    batch-1 point), and this engine's batch-1 point is left to test its costs. A published length stays."""
    import json

    lengths: dict[tuple, tuple[float, str]] = {}
    for path in profiles:
        try:
            meta = json.loads(meta_file(path).read_text())
            block = meta["calibration"]
            model, draft = block["points"][0]["model"], meta["draft"]["config"]
            for key, record in block["acceptance"].items():
                if isinstance(record, dict) and not record.get("source"):
                    lengths[(model, draft, key)] = (float(record["acceptance_length"]), shown(path))
        except FileNotFoundError:
            raise UserError(f"--acceptance-from {path}: file not found (a profile of calibrate --published)") from None
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise UserError(f"--acceptance-from {path}: not a profile of calibrate --published ({exc})") from None
    for curve in curves:
        found = lengths.get((curve.setup.model, curve.setup.draft, acceptance_key(curve)))
        if found is not None and curve.trace is None and not curve.given and curve.setup.tree is None:
            curve.acceptance, curve.given = {"acceptance_length": found[0]}, found[1]


@dataclass(frozen=True)
class Tpot:
    """A single-request TPOT row (vLLM issue #20780): its setup, acceptance length, milliseconds and where."""

    setup: Setup
    acceptance_length: float
    tpot_ms: float
    where: str


def tpots_of(rows: list[dict[str, Any]], path: str) -> list[Tpot]:
    """The batch1 TPOT rows of a published table (speculative ones with their acceptance length)."""
    out = []
    for row in rows:
        if row["batch_kind"] == "batch1" and row["figure"] == "tpot_ms":
            where = f"{path}: line {row['line']}"
            if row["method"] != "none" and row["acceptance_length"] is None:
                raise UserError(f"{where}: acceptance_length is needed for a speculative TPOT")
            out.append(Tpot(setup_of(row, where), row["acceptance_length"] or 1.0, row["value"], where))
    return out


# -- the fit ------------------------------------------------------------------------------------------------------
#: The parameters fitted to each engine's runs (the rest keep the start's: ``--start``, for SGLang by default the
#: shipped vLLM calibration's): SGLang's published runs are all EAGLE heads and have no single-request TPOT, so its
#: kernels' efficiencies, the target's per-pass overhead and a step's fixed host work are vLLM's (one GPU, the same
#: kinds of kernels, CUDA graphs in both) and only what its engine does otherwise is fitted: the per-sequence work of
#: every step, a speculative step's extra work (fixed and per sequence) and the head's per-pass overhead. (SGLang's
#: overlap scheduler, on without speculation and off with EAGLE, would hide a plain step's host work: a fit with the
#: plain step's host work at 0 leaves every SGLang curve at batch 128 far below the published one, so it is not taken.)
FITTED = {"vllm": ("compute", "bandwidth", "compute_half_tokens", "roofline_exponent", "pass_overhead_s", "step_s",
                   "step_per_seq_s", "spec_s", "ngram_per_seq_s", "head_pass_s", "draft_pass_s",
                   "draft_pass_per_layer_s"),
          "sglang": ("step_per_seq_s", "spec_s", "spec_per_seq_s", "head_pass_s")}
#: Physical ranges: efficiencies in (0, 1], seconds >= 0 (and below 20 ms: an overhead larger than a 70B pass).
BOUNDS = {"compute": (0.05, 1.0), "bandwidth": (0.05, 1.0), "compute_half_tokens": (0.0, 2048.0),
          "roofline_exponent": (2.0, 32.0)}
#: Parameters a calibration written before them may lack (their default, the form without them, is then read).
OPTIONAL = ("roofline_exponent",)
SECONDS_BOUND = (0.0, 0.02)
#: Fig. 4 is matched on its batch-1 rows (its larger batches are held out: the breakdown runs' lengths are not
#: published, and beyond batch 1 the KV reads that depend on them dominate); weights of its shares and of a TPOT's log
#: ratio beside a speedup's absolute error.
BREAKDOWN_FIT_BATCHES = (1,)
BREAKDOWN_WEIGHT = 0.5
TPOT_WEIGHT = 0.5


@dataclass
class Prediction:
    """What a calibration predicts for every published point (fitted or held out)."""

    speedups: list[dict[int, float]]
    """Per curve, by batch size."""
    tpots: list[float]
    """Per TPOT row, milliseconds."""
    breakdown: list[dict[str, float]]
    """Per breakdown row: its ``drafting`` and ``rest`` (sampling + overhead) shares."""


class Fit:
    """The least-squares fit of an engine's parameters and of its curves' inferred acceptance (module docstring). Fitted
    are: the speedups at ``fit_batches`` (a replayed curve's batch 1 excepted: its acceptance is recorded, so that
    point tests the costs; an inferred curve's batch 1 gives its acceptance length, an inferred n-gram curve's
    largest fitted batch its match share; a held-out curve's acceptance points only, :meth:`Curve.fits`), the
    single-request TPOT without speculation, Fig. 4's batch-1 shares and its n-gram drafting share at every batch
    (the lookup's host seconds per sequence)."""

    def __init__(self, engine: str, curves: list[Curve], tpots: list[Tpot], breakdown: list[dict[str, Any]],
                 benches: dict[str, Bench], start: SpecCalibration, fit_batches: Sequence[int]) -> None:
        self.engine, self.curves, self.tpots, self.benches, self.start = engine, curves, tpots, benches, start
        self.names = FITTED[engine]
        self.fit_batches = tuple(fit_batches)
        self.unknowns = [(curve, name) for curve in curves for name in curve.unknowns]
        by = {(c.setup.model, c.setup.method, c.dataset): c for c in curves}
        self.breakdown = [(row, by[(row["model"], row["method"], "cnn_dailymail")] if row["method"] != "none" else
                          next(c for c in curves if c.setup.model == row["model"]))
                          for row in breakdown if row["method"] == "none" or (row["model"], row["method"],
                                                                            "cnn_dailymail") in by]
        self._trace_steps = {id(c): c.steps(benches[c.dataset]) for c in curves if c.trace is not None}
        self._plain = {name: oc.plain_steps(bench.prompts) for name, bench in benches.items()}
        self.evaluations = 0

    # parameters <-> vector: the fitted fields in units of their start, then the curves' unknown acceptance figures
    def vector(self, cal: SpecCalibration) -> np.ndarray:
        start = [1.0 if name == "match" else min(2.0, curve.bounds(name)[1]) for curve, name in self.unknowns]
        return np.array([getattr(cal, n) / self._unit(n) for n in self.names] + start)

    def unpack(self, x: np.ndarray) -> tuple[SpecCalibration, dict[int, dict[str, float]]]:
        cal = replace(self.start, **{n: float(v) * self._unit(n) for n, v in zip(self.names, x)})
        acceptance: dict[int, dict[str, float]] = {}
        for (curve, name), value in zip(self.unknowns, x[len(self.names):]):
            acceptance.setdefault(id(curve), {})[name] = float(value)
        return cal, acceptance

    def _unit(self, name: str) -> float:  # the scale a parameter is fitted in: its default (1 where that is 0)
        return getattr(SpecCalibration(), name) or 1.0

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        ranges = [tuple(v / self._unit(n) for v in BOUNDS.get(n, SECONDS_BOUND)) for n in self.names]
        ranges += [curve.bounds(name) for curve, name in self.unknowns]
        return np.array([r[0] for r in ranges]), np.array([r[1] for r in ranges])

    def steps(self, curve: Curve, acceptance: dict[str, float] | None) -> tuple[oc.Steps, np.ndarray]:
        """:meth:`Curve.steps` (a replayed curve's made once)."""
        found = self._trace_steps.get(id(curve))
        return found if found is not None else curve.steps(self.benches[curve.dataset], acceptance)

    def fitted(self, curve: Curve, batch: int) -> bool:
        """Whether the fit sees the point (:meth:`Curve.fits`)."""
        return curve.fits(batch, self.fit_batches)

    def breakdown_fitted(self, row: dict[str, Any]) -> tuple[bool, bool]:
        """Whether the fit sees a Fig. 4 row's (drafting, rest) shares."""
        single = row["batch_size"] in BREAKDOWN_FIT_BATCHES
        return single or row["method"] == "ngram", single

    def predict(self, cal: SpecCalibration, acceptance: dict[int, dict[str, float]],
                fitted_only: bool = False) -> Prediction:
        """Every point's prediction by the twin (:class:`Twin`) at ``cal`` and the inferred ``acceptance``
        (``fitted_only``: the fitted points only, the rest NaN)."""
        self.evaluations += 1
        twins: dict[Setup, Twin] = {}
        plain: dict[tuple, np.ndarray] = {}

        def twin(setup: Setup) -> Twin:
            if setup not in twins:
                twins[setup] = Twin(setup, cal)
            return twins[setup]

        def baseline(curve: Curve, batch: int) -> np.ndarray:
            key = (curve.setup.engine, curve.setup.gpu, curve.setup.tp, curve.setup.target, curve.dataset, batch)
            if key not in plain:
                bench = self.benches[curve.dataset]
                plain[key] = twin(plain_setup(curve.setup)).prompt_seconds(batch, bench.prompts,
                                                                            self._plain[curve.dataset])
            return plain[key]

        speedups = []
        for curve in self.curves:
            bench = self.benches[curve.dataset]
            steps, outputs = self.steps(curve, acceptance.get(id(curve)))
            prompts = oc.Prompts(bench.prompts.prompt_tokens, outputs)
            speedups.append({b: oc.speedup(twin(curve.setup).prompt_seconds(b, prompts, steps), outputs,
                                           baseline(curve, b), bench.prompts.output_tokens, b)
                             if self.fitted(curve, b) or not fitted_only else math.nan for b in curve.points})
        tpots = []
        for row in self.tpots:
            fitted = row.setup.method == "none"
            tpots.append(float(twin(row.setup).steps(1, tpot_step(row))[0]) / row.acceptance_length * 1e3
                         if fitted or not fitted_only else math.nan)
        shares = []
        for row, curve in self.breakdown:
            if fitted_only and not any(self.breakdown_fitted(row)):
                shares.append({"drafting": math.nan, "rest": math.nan})
                continue
            if row["method"] == "none":
                setup, steps = plain_setup(curve.setup), self._plain["cnn_dailymail"]
            else:
                setup, steps = curve.setup, self.steps(curve, acceptance.get(id(curve)))[0]
            parts = twin(setup).parts(row["batch_size"], steps)
            total = sum(parts.values())
            shares.append({"drafting": parts["drafting"] / total, "rest": parts["rest"] / total})
        return Prediction(speedups, tpots, shares)

    def residuals(self, x: np.ndarray) -> np.ndarray:
        """The fitted residuals (class docstring) at ``x``, in :meth:`sparsity`'s order."""
        cal, acceptance = self.unpack(x)
        p = self.predict(cal, acceptance, fitted_only=True)
        out = []
        for curve, predicted in zip(self.curves, p.speedups):
            out += [predicted[b] - value for b, (value, _) in sorted(curve.points.items()) if self.fitted(curve, b)]
        out += [TPOT_WEIGHT * math.log(t / row.tpot_ms) for row, t in zip(self.tpots, p.tpots)
                if row.setup.method == "none"]
        for (row, _), share in zip(self.breakdown, p.breakdown):
            drafting, rest = self.breakdown_fitted(row)
            if drafting:
                out.append(BREAKDOWN_WEIGHT * (share["drafting"] - row["frac_drafting"]))
            if rest:
                out.append(BREAKDOWN_WEIGHT * (share["rest"] - row["frac_sampling"] - row["frac_overhead"]))
        return np.array(out)

    def sparsity(self) -> np.ndarray:
        """Which residual each parameter moves: the engine's parameters all; a curve's acceptance figures its points
        and its Fig. 4 rows (the grouped finite differences then cost one evaluation for all of them)."""
        columns: dict[int, list[int]] = {}
        for j, (curve, _) in enumerate(self.unknowns):
            columns.setdefault(id(curve), []).append(len(self.names) + j)
        rows: list[list[int]] = []
        for curve in self.curves:
            rows += [columns.get(id(curve), []) for b in sorted(curve.points) if self.fitted(curve, b)]
        rows += [[] for row in self.tpots if row.setup.method == "none"]
        for row, curve in self.breakdown:
            own = columns.get(id(curve), []) if row["method"] != "none" else []
            rows += [own] * sum(self.breakdown_fitted(row))
        matrix = np.zeros((len(rows), len(self.names) + len(self.unknowns)), dtype=int)
        matrix[:, :len(self.names)] = 1
        for i, own in enumerate(rows):
            matrix[i, own] = 1
        return matrix

    def run(self, max_evaluations: int) -> tuple[SpecCalibration, dict[int, dict[str, float]]]:
        """The fitted parameters and acceptance (scipy's bounded ``least_squares``, ``trf``, from :attr:`start`,
        acceptance lengths of 2 and match shares of 1); each inferred curve's :attr:`Curve.acceptance` set."""
        from scipy.optimize import least_squares

        lo, hi = self.bounds()
        x0 = np.clip(self.vector(self.start), lo, hi)
        result = least_squares(self.residuals, x0, bounds=(lo, hi), jac_sparsity=self.sparsity(), method="trf",
                               x_scale="jac", max_nfev=max_evaluations)
        # a parameter within 1e-9 of its unit of the lower bound is at the bound: recorded as the bound itself
        x = np.where(result.x - lo < 1e-9, lo, result.x)
        cal, acceptance = self.unpack(x)
        for curve in self.curves:
            if curve.unknowns:
                curve.acceptance = acceptance[id(curve)]
        return cal, acceptance


def plain_setup(setup: Setup) -> Setup:
    """The setup's engine and target without speculation (the speedup's denominator)."""
    return replace(setup, method="none", drafter="", draft=None, k=0, tree=None)


def tpot_step(row: Tpot) -> oc.Steps:
    """The one step a single-request TPOT row describes: k proposed over :data:`TPOT_CONTEXT` tokens, the drafter's
    first pass fed by the engine's rule (its mean acceptance length under vLLM 0.10's)."""
    setup = row.setup
    feed = {"accepted": row.acceptance_length, "padded": setup.k + 1.0}.get(setup.draft_extend, 1.0)
    return oc.Steps(np.zeros(1, np.int64), np.array([float(TPOT_CONTEXT)]), np.array([setup.k]), np.array([feed]),
                    np.ones(1))


# -- profiles -----------------------------------------------------------------------------------------------------
#: The grid speculative profiles are written over: batch sizes to 512, contexts to 16,384 (SpecDecode-Bench's outputs
#: reach 8,192 after prompts of up to 2,000), prefills in chunks of up to 16,384 tokens (vLLM V1's on an H100), query
#: lengths to 9 (k <= 8) and, for SGLang's trees, to 24 (21 draft tokens and the root); draft passes fed up to 9 tokens
#: a sequence (the first pass of a step: the accepted tokens and the bonus, or every verified one).
SPEC_GRID = Grid(batch_sizes=powers_of_two(1, 512), query_lens=tuple(range(1, 10)),
                 context_lens=powers_of_two(16, 16384), prefill_lens=powers_of_two(16, 16384),
                 max_prefill_tokens=oc.CHUNK_TOKENS, draft_query_lens=tuple(range(1, 10)))
TREE_GRID = replace(SPEC_GRID, query_lens=SPEC_GRID.query_lens + (12, 16, 24))
#: A profile's name for a target whose config is another model's of the same shape (published.CONFIGS).
PROFILE_NAMES = {"meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b"}


def engine_token(setup: Setup) -> str:
    """The engine and version in a profile's name: ``vllm0.10``, ``vllm0.11``, ``sglang0.5``; a run whose version is
    not stated (SpecDecode-Bench's draft-model branch) takes the version of the target's other runs."""
    major, minor = _version(setup.version)
    return f"{setup.engine}{major}.{minor}" if (major, minor) != (0, 0) else setup.engine


def profile_stem(setup: Setup, token: str) -> str:
    """``<gpu>[x<tp>]-<engine><version>__<target>__<drafter or ngram>``."""
    gpus = f"{setup.gpu}x{setup.tp}" if setup.tp > 1 else setup.gpu
    target = PROFILE_NAMES.get(setup.model, setup.target)
    return f"{gpus}-{token}__{target}__{setup.draft or 'ngram'}"


def spec_profile(setup: Setup, cal: SpecCalibration) -> tuple[pd.DataFrame, dict[str, Any]]:
    """The profile of ``setup``'s deployment at ``cal`` (module docstring): the roofline's target and drafter passes
    (the drafter's at its own per-pass overhead), the host work of a step as ``overhead`` rows, what speculation adds
    as ``spec_overhead`` rows, and the engine's ``draft_extend`` rule. No ``frontend`` rows: an offline engine has no
    API server."""
    grid = TREE_GRID if setup.engine == "sglang" else SPEC_GRID
    _, draft = architectures(setup.target, setup.draft)
    dep = Deployment(setup.gpu, setup.target, setup.draft or "", setup.tp, draft_tp=setup.tp)
    frame, meta = analytical_profile(dep, grid, eff=cal.efficiency(),
                                     draft_eff=cal.draft_efficiency(draft) if draft is not None else None)
    extra = [{"role": "target", "phase": "overhead", "batch_size": b, "query_len": 0, "context_len": 0,
              "seconds": cal.step_s + cal.step_per_seq_s * b} for b in grid.batch_sizes]
    extra += [{"role": "target", "phase": "spec_overhead", "batch_size": b, "query_len": q, "context_len": 0,
               "seconds": cal.spec_seconds(b, setup.method == "ngram")}
              for b in grid.batch_sizes for q in grid.query_lens if q > 1]
    extra = [row for row in extra if row["seconds"] > 0]  # a part fitted to 0 is left out: priced as 0
    meta["draft_extend"] = setup.draft_extend
    if setup.draft is None:
        meta["draft"]["note"] = "no drafter: vLLM's n-gram prompt lookup (its host work in the spec_overhead rows)"
    return pd.concat([frame, pd.DataFrame(extra)], ignore_index=True), meta


def profile_cost(setup: Setup, cal: SpecCalibration) -> CostModel:
    """The simulator's cost model of ``setup`` at ``cal`` (:func:`spec_profile`, fitted as a calibrated profile:
    ``interp``)."""
    frame, meta = spec_profile(setup, cal)
    return fit_cost_model(ProfileTable(frame=frame, meta={**meta, "calibration": {"engine": setup.engine}},
                                       path=setup.label), "interp")


# -- the reproduction through the profiles -----------------------------------------------------------------------
def simulate_curve(curve: Curve, cost: CostModel, bench: Bench) -> dict[int, float]:
    """The curve's speedups priced through ``cost`` by the simulated engine's step formula
    (:func:`simulator.studies.offline_copies.prompt_seconds`; the denominator the same engine without speculation)."""
    setup = curve.setup
    steps, outputs = curve.steps(bench)
    prompts = oc.Prompts(bench.prompts.prompt_tokens, outputs)
    shape = setup.shape() if setup.tree is not None else None
    plain = oc.plain_steps(bench.prompts)
    out = {}
    for b in sorted(curve.points):
        with_spec = oc.prompt_seconds(cost, prompts, steps, b, setup.drafts, (lambda k: shape) if shape else None)
        without = oc.prompt_seconds(cost, bench.prompts, plain, b, False)
        out[b] = oc.speedup(with_spec, outputs, without, bench.prompts.output_tokens, b)
    return out


def implied_acceptance(curve: Curve, cost: CostModel, bench: Bench) -> tuple[float, float | None]:
    """For a curve of measured acceptance (:attr:`Curve.known`): the measured acceptance length (a replayed stream's,
    pooled over its steps; or the published one) and the one its batch-1 speedup implies under ``cost`` (expected
    steps, an n-gram's at its recorded match share; None when no length in [1, depth + 1] gives it): where they differ,
    the measured acceptance does not describe the published run under these costs."""
    from scipy.optimize import brentq

    setup, shape = curve.setup, curve.setup.shape()
    if curve.trace is not None:
        measured = float(np.mean(np.concatenate([accepted for _, accepted in bench.streams[curve.trace]]) + 1))
    else:
        measured = curve.acceptance["acceptance_length"]
    if 1 not in curve.points:
        return measured, None
    value = curve.points[1][0]
    match = bench.match(setup.k) if setup.method == "ngram" else 1.0
    tree = (lambda k: shape) if setup.tree is not None else None
    plain = oc.prompt_seconds(cost, bench.prompts, oc.plain_steps(bench.prompts), 1, False)

    def gap(length: float) -> float:
        expected = oc.expected_steps(bench.prompts, length, shape.num_nodes, setup.draft_extend, match, shape.depth)
        with_spec = oc.prompt_seconds(cost, bench.prompts, expected, 1, setup.drafts, tree)
        return oc.speedup(with_spec, bench.prompts.output_tokens, plain, bench.prompts.output_tokens, 1) - value

    low, high = 1.0, shape.depth + 1.0
    if gap(low) * gap(high) > 0:
        return measured, None
    return measured, float(brentq(gap, low, high, xtol=1e-3))


def status(curve: Curve, batch: int, fit_batches: Sequence[int]) -> str:
    """``fitted: acceptance length`` / ``fitted: match share`` (the point gave the curve's acceptance), ``fitted``
    (the costs' fit saw it) or ``held out``."""
    inferred = curve.inferred_at(batch, fit_batches)
    if inferred is not None:
        return "fitted: " + ("acceptance length" if inferred == "acceptance_length" else "match share")
    return "fitted" if curve.fits(batch, fit_batches) else "held out"


def reproduction(curves: list[Curve], costs: dict[Setup, CostModel], benches: dict[str, Bench],
                 fit_batches: Sequence[int]) -> pd.DataFrame:
    """One row per published point: the setup, dataset and batch, the published and simulated speedups, the error and
    the point's status (:func:`status`), the acceptance the run used."""
    rows = []
    for curve in curves:
        simulated = simulate_curve(curve, costs[curve.setup], benches[curve.dataset])
        if curve.trace:
            recorded, implied = implied_acceptance(curve, costs[curve.setup], benches[curve.dataset])
            acceptance = f"replayed {curve.trace}: AL {recorded:.3f}" + (
                f", batch 1 implies {implied:.3f}" if implied is not None else "")
        elif curve.given:
            measured, implied = implied_acceptance(curve, costs[curve.setup], benches[curve.dataset])
            acceptance = f"{curve.given} AL {measured:.3f}" + (
                f", batch 1 implies {implied:.3f}" if implied is not None else "")
        else:
            acceptance = ", ".join(f"{'AL' if k == 'acceptance_length' else k} {v:.3f}"
                                   for k, v in curve.acceptance.items())
        for b in sorted(curve.points):
            value, where = curve.points[b]
            rows.append({"engine": curve.setup.engine, "version": curve.setup.version, "model": curve.setup.model,
                         "method": curve.setup.method, "k": curve.setup.k,
                         "tree": str(curve.setup.tree) if curve.setup.tree else "", "dataset": curve.dataset,
                         "batch": b, "published": value, "simulated": simulated[b], "error": simulated[b] - value,
                         "status": status(curve, b, fit_batches), "acceptance": acceptance, "where": where})
    return pd.DataFrame(rows)


def summary(table: pd.DataFrame) -> pd.DataFrame:
    """Per engine, model and method (k, tree): the largest |error| of the fitted points and of the held-out ones, and
    the held-out median."""
    rows = []
    keys = ["engine", "model", "method", "k", "tree"]
    for key, group in table.groupby(keys, sort=False):
        held = group[group["status"] == "held out"]["error"].abs()
        fitted = group[group["status"] != "held out"]["error"].abs()
        rows.append({**dict(zip(keys, key)), "points": len(group), "fitted_max": fitted.max(),
                     "held_out_max": held.max(), "held_out_median": held.median()})
    return pd.DataFrame(rows)


# -- the command --------------------------------------------------------------------------------------------------
#: Where an SGLang fit takes its kernel efficiencies from (``--start``'s default): the vLLM calibration's.
DEFAULT_START = DATA_DIR / "h100-80gb-vllm0.10__llama-3.1-8b__eagle3-llama-3.1-8b.meta.json"
REPRODUCE = "python run_sim.py calibrate --published {files} --reproduce"


def write_profiles(curves: list[Curve], tpots: list[Tpot], predicted: Prediction, fit: Fit, cal: SpecCalibration,
                   table: pd.DataFrame, stems: dict[Setup, str], out_dir: Path, args: argparse.Namespace) -> None:
    """One profile per stem (:func:`profile_stems`) with its metadata's ``calibration`` block: the engine, the files,
    the parameters (value, unit, what identified each), the acceptance each curve used, every point of its setups
    (published, simulated through the profile, error, fitted or held out) and the held-out summary; the TPOT and
    breakdown checks of the whole fit."""
    files = [shown(p) for p in args.published]
    checks = {"tpot": [{"setup": t.setup.label, "acceptance_length": t.acceptance_length, "tpot_ms": t.tpot_ms,
                        "simulated_tpot_ms": v, "relative_error": v / t.tpot_ms - 1,
                        "status": "fitted" if t.setup.method == "none" else "held out", "where": t.where}
                       for t, v in zip(tpots, predicted.tpots)],
              "breakdown": [{"model": row["model"], "method": row["method"], "batch": row["batch_size"],
                             "drafting": row["frac_drafting"], "simulated_drafting": share["drafting"],
                             "rest": row["frac_sampling"] + row["frac_overhead"], "simulated_rest": share["rest"],
                             "status": "fitted" if any(fit.breakdown_fitted(row)) else "held out"}
                            for (row, _), share in zip(fit.breakdown, predicted.breakdown)]}
    for stem in sorted(set(stems.values())):
        setups = [s for s in stems if stems[s] == stem]
        mine = [c for c in curves if c.setup in setups]
        points = table[table["where"].isin([w for c in mine for _, w in c.points.values()])]
        held = points[points["status"] == "held out"]["error"].abs()
        frame, meta = spec_profile(setups[0], cal)
        meta["calibration"] = {
            "note": f"calibrated to {setups[0].engine}'s own speculative runs (profiles/spec_calibrate.py)",
            "engine": setups[0].engine, "engine_versions": sorted({s.version for s in setups}),
            "draft_extend": setups[0].draft_extend, "files": files, "breakdown": shown(args.breakdown),
            "spec_parameters": cal.record(), "fitted": list(fit.names), "fit_batches": list(fit.fit_batches),
            "held_out_methods": sorted({c.setup.method for c in curves if c.held_out}),
            "fit": {"method": "scipy least_squares (trf, bounded), speedups' absolute errors, TPOT and breakdown "
                              "residuals weighted by 0.5 (profiles/spec_calibrate.py Fit)",
                    "evaluations": fit.evaluations},
            "workload": "SpecDecode-Bench's prompts of the recorded traces (37 CNN/DailyMail, 60 GSM8K, 88 "
                        "InstructCoder, 24 ShareGPT) with Llama-3.1-8B-Instruct's lengths "
                        "(profiles/data/specdecode_bench)",
            "acceptance": {acceptance_key(c): f"replayed: {c.trace}" if c.trace else
                           {**c.acceptance, **({"source": c.given} if c.given else {})} for c in mine},
            "points": points.drop(columns=["engine"]).to_dict("records"),
            "held_out_summary": {"points": int(held.size),
                                 "median_abs_error": float(held.median()) if held.size else None,
                                 "max_abs_error": float(held.max()) if held.size else None,
                                 "method": "points the fit did not see, priced through this profile"},
            "checks": checks,
            "fit_command": "python run_sim.py calibrate " + " ".join(args.argv),
            "reproduce": REPRODUCE.format(files=" ".join(files)),
        }
        meta["efficiency_source"] = f"calibrated to {setups[0].engine}'s speculative runs: {', '.join(files)}"
        write_profile(frame, meta, out_dir / f"{stem}.csv")
        print(f"profile: {out_dir / f'{stem}.csv'}")


def load_profiles(curves: list[Curve], stems: dict[Setup, str],
                  out_dir: Path) -> tuple[dict[Setup, CostModel], tuple[int, ...]]:
    """The written profiles of the curves' setups as cost models, each inferred curve's acceptance set from its
    profile's record, and the batch sizes the fit saw."""
    import json

    from simulator.costs.cost_model import load_cost_model

    costs: dict[Setup, CostModel] = {}
    fit_batches: tuple[int, ...] = ()
    for curve in curves:
        path = out_dir / f"{stems[curve.setup]}.csv"
        if not path.is_file():
            raise UserError(f"--reproduce: {path} not found: run calibrate --published without --reproduce first "
                            "(--out-dir names where the profiles are)")
        if curve.setup not in costs:
            costs[curve.setup] = load_cost_model(path, "auto")
        block = json.loads(meta_path(path).read_text())["calibration"]
        fit_batches = tuple(block["fit_batches"])
        curve.held_out = curve.setup.method in block.get("held_out_methods", ())
        recorded = block["acceptance"].get(acceptance_key(curve))
        if recorded is None:
            raise UserError(f"--reproduce: {path} records no acceptance for {acceptance_key(curve)}: refit")
        if curve.trace is None:
            curve.acceptance = {k: v for k, v in recorded.items() if k != "source"}
            curve.given = recorded.get("source", "")
    return costs, fit_batches

def acceptance_key(curve: Curve) -> str:
    """A curve's key in a profile's ``acceptance`` record: method, k or tree, dataset."""
    tree = f" {curve.setup.tree}" if curve.setup.tree else ""
    return f"{curve.setup.method} k={curve.setup.k}{tree} {curve.dataset}"


def profile_stems(setups: Sequence[Setup]) -> dict[Setup, str]:
    """Each setup's profile stem (:func:`profile_stem`); a setup whose version is not stated takes the version of its
    target's other setups on the engine (SpecDecode-Bench's draft-model runs: one figure with the others)."""
    known = {(s.engine, s.model): engine_token(s) for s in setups if _version(s.version) != (0, 0)}
    return {s: profile_stem(s, engine_token(s) if _version(s.version) != (0, 0)
                            else known.get((s.engine, s.model), s.engine)) for s in setups}


def read_start(path: str) -> SpecCalibration:
    """The parameters of an earlier speculative calibration (a profile's ``.meta.json`` or its CSV)."""
    import json

    try:
        record = json.loads(meta_file(path).read_text())["calibration"]["spec_parameters"]
        return SpecCalibration(**{f.name: float(record[f.name]["value"]) for f in fields(SpecCalibration)
                                  if f.name in record or f.name not in OPTIONAL})
    except FileNotFoundError:
        raise UserError(f"--start {path}: file not found (a speculative calibrated profile's .meta.json)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"--start {path}: not a speculative calibration's metadata (spec_parameters: {exc})") from None


def format_table(table: pd.DataFrame) -> str:
    """The reproduction table, one line a point, and its summary per engine, model and method."""
    shown = table[["model", "method", "k", "tree", "dataset", "batch", "published", "simulated", "error", "status",
                   "acceptance"]].copy()
    shown["model"] = shown["model"].str.split("/").str[-1]
    lines = [shown.to_string(index=False, float_format=lambda v: f"{v:.3f}")]
    lines.append("")
    lines.append(summary(table).to_string(index=False, float_format=lambda v: f"{v:.3f}"))
    held = table[table["status"] == "held out"]["error"].abs()
    lines.append(f"\n{len(table)} points, {len(held)} held out: |error| median {held.median():.3f}, worst "
                 f"{held.max():.3f}; {int((table['error'].abs() > 0.1).sum())} points beyond 0.1")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="run_sim.py calibrate --published", description=__doc__.splitlines()[0],
        epilog="SpecDecode-Bench's Fig. 1 (vLLM) through the shipped profiles: run_sim.py calibrate --published "
               "profiles/data/specdecode_bench/fig1_speedup.csv profiles/data/vllm_eagle/h100__llama-3.1-8b__bs1_"
               "mtbench.csv --reproduce; its Fig. 2 (SGLang): --published profiles/data/specdecode_bench/"
               "fig2_sglang.csv --reproduce")
    parser.add_argument("--published", nargs="+", required=True, metavar="TABLE",
                        help="published tables of one engine (profiles/data/README.md), e.g. "
                             "profiles/data/specdecode_bench/fig1_speedup.csv")
    parser.add_argument("--breakdown", default=str(BREAKDOWN),
                        help="a step-time breakdown table of the engine's runs (default: SpecDecode-Bench's Fig. 4, "
                             "vLLM only; 'none': without)")
    parser.add_argument("--fit-batches", default="1,64,128", help="the batch sizes whose speedups are fitted "
                                                                   "(default 1,64,128; the rest held out)")
    parser.add_argument("--out-dir", default=str(DATA_DIR), help="where the profiles are written (or, with "
                                                                 "--reproduce, read; default profiles/data)")
    parser.add_argument("--hold-out-methods", default="", metavar="METHODS",
                        help="speculative methods (the tables' method names, comma-separated, e.g. draft_model) whose "
                             "curves the costs' fit leaves out: only their acceptance is fitted to them, every other "
                             "point of theirs is predicted by the costs fitted to the other methods (profiles written "
                             "so are a test; --out-dir elsewhere)")
    parser.add_argument("--acceptance-from", nargs="+", default=[], metavar="PROFILE",
                        help="profiles of another engine's calibrate --published: a chain curve of the same target, "
                             "drafter, k and dataset takes the acceptance length inferred there (its batch 1 is then "
                             "held out here), e.g. SGLang's chains from the vLLM profiles")
    parser.add_argument("--reproduce", action="store_true", help="fit nothing: price every published point through "
                                                                 "the profiles in --out-dir and print the table")
    parser.add_argument("--start", help="start from this speculative calibration (a profile CSV or .meta.json); an "
                                        "SGLang fit keeps its kernel efficiencies (default: the shipped vLLM 0.10 "
                                        "Llama-3.1-8B EAGLE-3 profile)")
    parser.add_argument("--max-evals", type=int, default=400, help="evaluations of the fit (default 400)")
    parser.add_argument("--table", metavar="CSV", help="also write the reproduction table as CSV")
    args = parser.parse_args(argv)
    args.argv = list(argv)
    try:
        fit_batches = tuple(int(b) for b in args.fit_batches.split(","))
    except ValueError:
        raise UserError(f"--fit-batches: comma-separated whole numbers (got {args.fit_batches!r})") from None
    if args.max_evals < 1:
        raise UserError(f"--max-evals: must be >= 1 (got {args.max_evals})")
    rows = {path: read_published(path) for path in args.published}
    engines = {row["engine"] for table in rows.values() for row in table}
    if len(engines) != 1:
        raise UserError(f"--published: the tables mix engines ({', '.join(sorted(engines))}); calibrate one engine at "
                        "a time")
    engine = engines.pop()
    benches = {d: Bench.load(d) for d in DATASETS}
    curves = [c for path, table in rows.items() for c in curves_of(table, path, benches)]
    tpots = [t for path, table in rows.items() for t in tpots_of(table, path)]
    if not curves:
        raise UserError("--published: no offline_copies speedup rows to fit or reproduce")
    held_out = {m.strip() for m in args.hold_out_methods.split(",") if m.strip()}
    unknown = held_out - {c.setup.method for c in curves}
    if unknown:
        raise UserError(f"--hold-out-methods: no curve of method {sorted(unknown)[0]!r} in the tables (methods: "
                        f"{', '.join(sorted({c.setup.method for c in curves}))})")
    if (held_out or args.acceptance_from) and args.reproduce:
        raise UserError("--hold-out-methods, --acceptance-from: apply to a fit; --reproduce reads what the profiles' "
                        "fit held out and the acceptance it used")
    borrow_acceptance(curves, args.acceptance_from)
    for curve in curves:
        curve.held_out = curve.setup.method in held_out
    stems = profile_stems([c.setup for c in curves] + [t.setup for t in tpots if t.setup.method != "none"])
    out_dir = Path(args.out_dir)
    if args.reproduce:
        costs, fit_batches = load_profiles(curves, stems, out_dir)
        table = reproduction(curves, costs, benches, fit_batches)
    else:
        from profiles.published import read_breakdown

        breakdown = [] if args.breakdown == "none" or engine != "vllm" else read_breakdown(args.breakdown)
        start = read_start(args.start or str(DEFAULT_START)) if (args.start or engine == "sglang") \
            else replace(SpecCalibration(), spec_per_seq_s=0.0)
        fit = Fit(engine, curves, tpots, breakdown, benches, start, fit_batches)
        print(f"fitting {', '.join(fit.names)} and {len(fit.unknowns)} acceptance figures of {len(curves)} curves "
              f"({engine}) ...", flush=True)
        cal, _ = fit.run(args.max_evals)
        costs = {c.setup: None for c in curves}
        for setup in list(costs):
            costs[setup] = profile_cost(setup, cal)
        table = reproduction(curves, costs, benches, fit_batches)
        predicted = fit.predict(cal, {id(c): c.acceptance for c in curves if c.unknowns})
        write_profiles(curves, tpots, predicted, fit, cal, table, stems, out_dir, args)
    print(format_table(table))
    if args.table:
        table.to_csv(args.table, index=False)
    return 0
