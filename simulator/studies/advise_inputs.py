"""What ``advise`` is given: the deployment's drafters (profiles, identified by their metadata) and how well each one's
tokens are accepted (the user's figures, vLLM's counters, a trace, or a labelled published default).

**Drafters.** A profile prices one target on one GPU at one tensor-parallel degree, and its ``draft`` rows one drafter
(a draft model, or an EAGLE / EAGLE-3 / MTP head: ``draft.speculative_method``). :func:`identity` reads that from the
profile's ``.meta.json``: ``target.config``, ``device``, ``target.tensor_parallel``, ``draft.config`` and its method,
and the engine the costs describe: ``engine`` (a name, ``"vllm 0.10"``, or ``{"name": "vllm", "version": "0.10"}``;
profiles calibrated per engine and version carry it), else the engine of a profile fitted to an engine's own
speculative runs (``calibration.engine``, ``profiles/spec_calibrate.py``) at the major.minor release its
``calibration.engine_versions`` agree on (none where they name no release, or several), else ``vllm`` for a profile
calibrated to vLLM results (its version not recorded), else ``unspecified``. A profile without a draft config prices
n-gram prompt lookup (no drafter). Profiles of one deployment are those that agree on all but the drafter
(:attr:`Identity.deployment`); several given with ``--profile`` must, and :func:`discover` adds the profiles of the
same deployment found beside them and in ``profiles/data/`` (one per drafter), so a new engine's calibrated profiles
plug in by their metadata, whatever their file names.

**Acceptance** (:class:`Acceptance`), per speculative method, first found of:

1. ``--acceptance-length METHOD=AL[@K]``: a mean acceptance length AL (vLLM's: accepted tokens per draft + 1, the
   bonus token counted) measured at K speculative tokens (default :data:`DEFAULT_AL_K` = 3, vLLM's and the
   speculators project's usual ``num_speculative_tokens``, vllm-project/speculators PR #146), converted to the
   per-token acceptance a of Leviathan et al. (ICML 2023, eq. 1): AL = (1 - a^(K+1)) / (1 - a), solved for a by
   bisection (:func:`leviathan_rate`);
2. ``--acceptance-results METHOD=FILE``: a ``vllm bench serve --save-result`` file of a run with speculation on, whose
   counters (``vllm/benchmarks/serve.py``, from the server's ``vllm:spec_decode_*`` metrics) give the per-position
   acceptance ``spec_decode_per_position_acceptance_rates`` (accepted at position j / drafts, made conditional:
   a_j = r_j / r_(j-1)), else the acceptance length at K = draft tokens / drafts, converted as in 1;
3. ``--acceptance-trace [METHOD=]FILE``: recorded steps ``request_id,proposed,accepted``, replayed (and, for the
   robustness rerun, its per-position rates, :func:`simulator.inputs.acceptance.fit_acceptance`);
4. a **published default** (:func:`published_default`), labelled so in every output: EAGLE-3 and EAGLE on
   Llama-3.1-8B-Instruct in vLLM V1 on MT-Bench (vLLM issue #20780, ``profiles/data/vllm_eagle/``: mean acceptance
   length at k = 2..7, made per-position rates by :func:`positions_from_lengths`); EAGLE and n-gram on
   Llama-3.1-8B-Instruct in vLLM 0.10.1.1 on ShareGPT, CNN/DailyMail, GSM8K or InstructCoder (SpecDecode-Bench,
   ``profiles/data/specdecode_bench/acceptance_by_position.csv``, the k = 5 walk). Published figures measured on
   another target say so;
5. else an **assumed default**: the simulator's own ``--token-acceptance-prob`` 0.8 (no published figure ships for a
   draft model or an MTP head), labelled as an assumption.

n-gram lookups miss at most steps; a missed step verifies nothing and emits one token. The n-gram proposer finds a
continuation with probability ``ngram_match_prob`` m and then accepts by position. SpecDecode-Bench's rates are per
step (a miss counts as position 1 rejected): r_1 = m a_1; taking a_1 = a_2 (the first matched token accepted as often
as the second) gives m = r_1 / a_2. A user's or vLLM's n-gram acceptance length counts drafts only (vLLM counts a draft
where the lookup proposed), so it sets a and leaves m at the published default's.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable

from policies.draft_head import DEFAULT_DRAFT_METHOD, method_name
from policies.errors import UserError

REPO = Path(__file__).resolve().parents[2]
DATA = REPO / "profiles" / "data"
#: The k an acceptance length given without ``@K`` was measured at (module docstring).
DEFAULT_AL_K = 3
#: The assumed per-token acceptance where nothing better is known: the simulator's ``--token-acceptance-prob`` default.
ASSUMED_RATE = 0.8
#: Published acceptance (module docstring): vLLM issue #20780's table and SpecDecode-Bench's by-position rates.
VLLM_EAGLE_TABLE = DATA / "vllm_eagle" / "h100__llama-3.1-8b__bs1_mtbench.csv"
SPECDECODE_POSITIONS = DATA / "specdecode_bench" / "acceptance_by_position.csv"
#: Datasets with published acceptance: SpecDecode-Bench's four (EAGLE, n-gram) and MT-Bench (#20780: EAGLE, EAGLE-3).
DATASETS = ("sharegpt", "cnn_dailymail", "gsm8k", "instructcoder", "mtbench")
#: The target every published figure here was measured on.
PUBLISHED_TARGET = "llama-3.1-8b"
#: The search space's defaults (``advise``'s ``--families``, ``--ks``, ``--trees``; :mod:`simulator.studies.advise`):
#: the candidate families, the fixed k, and SGLang trees (num_steps, eagle_topk, num_draft_tokens): its documented
#: default 5/4/8, a shallower and a wider one.
FAMILIES = ("no-spec", "fixed-k", "tree", "vllm-batch-table", "sglang-adaptive", "goodput")
DEFAULT_KS = (1, 2, 3, 4, 5, 6, 7)
DEFAULT_TREES = ((5, 4, 8), (3, 4, 6), (6, 8, 16))


# -- drafters --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Identity:
    """What a profile prices, read from its metadata (module docstring)."""

    path: str
    target: str
    gpu: str
    tp: int
    draft: str | None
    method: str
    engine: str
    engine_version: str | None
    profile_method: str

    @property
    def deployment(self) -> tuple[str, str, int, str, str | None]:
        """What profiles of one deployment share: target, GPU, tensor-parallel degree, engine and its version."""
        return self.target, self.gpu, self.tp, self.engine, self.engine_version

    @property
    def engine_text(self) -> str:
        """The engine the costs describe, as outputs print it."""
        if self.engine == "unspecified":
            return f"unspecified (profile method: {self.profile_method})"
        version = self.engine_version or "version not recorded in the profile's metadata"
        return f"{self.engine} ({version}; profile method: {self.profile_method})"

    def describe(self) -> str:
        return f"{self.target} on {self.tp} x {self.gpu}"


def identity(path: str, flag: str = "--profile") -> Identity:
    """The :class:`Identity` of the profile CSV at ``path``; a profile without the metadata that says what it prices
    is one :class:`UserError` line naming it."""
    from simulator.costs.profile_table import meta_path, method_label

    p = Path(path)
    if p.suffix.lower() != ".csv" or not p.is_file():
        raise UserError(f"{flag} {path}: advise needs profile CSVs whose .meta.json names their target, GPU and draft "
                        "(profiles/data/*.csv)")
    try:
        meta = json.loads(meta_path(p).read_text())
        target, draft = meta["target"], meta.get("draft") or {}
        name, tp = str(target["config"]), int(target.get("tensor_parallel", 1))
        gpu = str((meta.get("gpu") or {}).get("name") or meta["device"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"{flag} {path}: its metadata ({meta_path(p).name}) does not say the target, GPU and tensor "
                        f"parallel it prices ({type(exc).__name__}: {exc})") from None
    engine, version = _engine(meta)
    config = draft.get("config") if isinstance(draft.get("config"), str) else None
    default = DEFAULT_DRAFT_METHOD if config else "ngram"  # no drafter: a profile of n-gram prompt lookup
    method = method_name(str(draft.get("speculative_method", default)), f"{flag} {path}")
    return Identity(str(p), name, gpu.split(" x ")[-1] if " x " in gpu else gpu, tp, config, method, engine, version,
                    method_label(meta))


def _engine(meta: dict[str, Any]) -> tuple[str, str | None]:
    """(engine name, version or None) of a profile's metadata (module docstring)."""
    engine = meta.get("engine")
    if isinstance(engine, dict) and engine.get("name"):
        version = engine.get("version")
        return str(engine["name"]).lower(), None if version is None else str(version)
    if isinstance(engine, str) and engine.strip():
        name, _, version = engine.strip().partition(" ")
        return name.lower(), version.strip() or None
    calibration = meta.get("calibration")
    if isinstance(calibration, dict) and calibration.get("engine"):  # profiles/spec_calibrate.py's record
        releases = [re.match(r"(\d+)\.(\d+)", str(v)) for v in calibration.get("engine_versions") or ()]
        minors = sorted({f"{m[1]}.{m[2]}" for m in releases if m})
        return str(calibration["engine"]).lower(), minors[0] if len(minors) == 1 else None
    return ("vllm", None) if calibration is not None else ("unspecified", None)


def deployment_of(paths: list[str]) -> list[Identity]:
    """The given profiles' identities, which must describe one deployment (one :class:`UserError` line otherwise)."""
    ids = [identity(p) for p in paths]
    for other in ids[1:]:
        if other.deployment != ids[0].deployment:
            first = ids[0]
            raise UserError(f"--profile: {Path(other.path).name} prices {other.describe()} ({other.engine_text}), "
                            f"{Path(first.path).name} {first.describe()} ({first.engine_text}): give profiles of one "
                            "target, GPU, tensor parallel and engine")
    return ids


def discover(given: list[Identity], folders: Iterable[Path] = ()) -> tuple[list[Identity], list[str]]:
    """The given profiles and, for every other drafter, the first profile (by path) of the same deployment found
    beside them or in ``folders``; and a note per profile looked at and not used (another deployment)."""
    chosen = {(i.method, i.draft): i for i in given}
    notes: list[str] = []
    seen = {Path(i.path).resolve() for i in given}
    roots = dict.fromkeys([Path(i.path).resolve().parent for i in given] + [Path(f).resolve() for f in folders])
    for root in roots:
        for path in sorted(root.glob("*.csv")):
            if path.resolve() in seen or not path.with_name(path.stem + ".meta.json").is_file():
                continue
            seen.add(path.resolve())
            try:
                other = identity(str(path))
            except UserError:
                continue
            if other.deployment != given[0].deployment:
                if other.target == given[0].target and other.gpu == given[0].gpu and other.tp == given[0].tp:
                    notes.append(f"{path.name}: same target and GPU, but {other.engine_text}: not used")
                continue
            chosen.setdefault((other.method, other.draft), other)
    return list(chosen.values()), notes


# -- acceptance ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Acceptance:
    """How a method's draft tokens are accepted (module docstring), as the simulator's acceptance fields."""

    method: str
    kind: str
    source: str
    """What was read and how it was converted, one line."""
    rate: float | None = None
    """Per-token acceptance (constant model)."""
    positions: tuple[float, ...] = ()
    """P(accept j | reached j), j = 1..; the last repeats (position model)."""
    match_prob: float | None = None
    """n-gram: the probability that the lookup proposes at a step."""
    trace: str | None = None
    """Recorded steps replayed (its :attr:`positions` stand for it when scaled)."""
    scale: float = 1.0

    def scaled(self, factor: float) -> "Acceptance":
        """Every per-token acceptance times ``factor`` (the robustness rerun's 0.8)."""
        return replace(self, scale=self.scale * factor)

    def fields(self) -> dict[str, Any]:
        """The config fields of this acceptance (``acceptance``, its rate or positions or trace, ``ngram_match_prob``)."""
        out: dict[str, Any] = {}
        if self.match_prob is not None:
            out["ngram_match_prob"] = self.match_prob
        if self.trace is not None and self.scale == 1.0:
            return {**out, "acceptance": "replay", "acceptance_trace": self.trace}
        if self.positions:
            return {**out, "acceptance": "position",
                    "acceptance_positions": tuple(min(1.0, p * self.scale) for p in self.positions)}
        return {**out, "acceptance": "constant", "acceptance_rate": min(1.0, float(self.rate) * self.scale)}

    def length(self, k: int) -> float:
        """The mean acceptance length at k (bonus included, per proposing step): 1 + sum_j prod_(i<=j) a_i."""
        rates = [min(1.0, (self.positions[min(j, len(self.positions) - 1)] if self.positions else float(self.rate))
                     * self.scale) for j in range(k)]
        total, reach = 1.0, 1.0
        for a in rates:
            reach *= a
            total += reach
        return total

    @property
    def label(self) -> str:
        """``KIND: what`` with the acceptance length at k = 3 (and the 0.8 scaling when applied)."""
        scaled = f", x{self.scale:g}" if self.scale != 1.0 else ""
        match = f", lookup match {self.match_prob:.2f}" if self.match_prob is not None else ""
        return f"{self.kind}{scaled}: AL {self.length(3):.2f} at k=3{match} ({self.source})"


def leviathan_rate(length: float, k: int, what: str) -> float:
    """The per-token acceptance a with (1 - a^(k+1)) / (1 - a) = ``length`` (Leviathan et al., eq. 1; a chain of k),
    by bisection (the left side rises from 1 at a = 0 to k + 1 at a = 1); ``length`` outside [1, k + 1] is a
    :class:`UserError` naming ``what``."""
    if not (math.isfinite(length) and 1.0 <= length <= k + 1):
        raise UserError(f"{what}: an acceptance length at k={k} is in [1, {k + 1}] (accepted + 1 bonus token per draft), "
                        f"got {length:g}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** j for j in range(k + 1)) < length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def positions_from_lengths(ks: list[int], lengths: list[float]) -> tuple[float, ...]:
    """Per-position acceptance from mean acceptance lengths measured at increasing k (``ks`` consecutive): AL(k) = 1 +
    sum_(j<=k) P(accepted >= j), so P(accepted >= k) = AL(k) - AL(k - 1); below the first k, one constant rate
    (:func:`leviathan_rate` of the first length) stands for every position; a_j = P(>= j) / P(>= j - 1)."""
    first = ks[0]
    a = leviathan_rate(lengths[0], first, "published acceptance")
    survive = [a ** j for j in range(1, first + 1)]
    for k, prev, now in zip(ks[1:], lengths, lengths[1:]):
        survive.append(max(0.0, now - prev))
    rates, before = [], 1.0
    for s in survive:
        rates.append(min(1.0, s / before) if before > 0 else 0.0)
        before = s
    return tuple(round(r, 4) for r in rates)


def published_default(method: str, target: str, dataset: str) -> Acceptance | None:
    """The published acceptance of ``method`` for the ``dataset`` (module docstring), or None where none ships."""
    import pandas as pd

    other = "" if target == PUBLISHED_TARGET else f"; measured on Llama-3.1-8B-Instruct, not {target}"
    if method in ("eagle", "eagle3") and (dataset == "mtbench" or method == "eagle3"):
        table = pd.read_csv(VLLM_EAGLE_TABLE)
        rows = table[(table["method"] == method) & table["acceptance_length"].notna()].sort_values(
            "num_speculative_tokens")  # the published-measurements format (profiles/data/README.md)
        ks, lengths = rows["num_speculative_tokens"].astype(int).tolist(), rows["acceptance_length"].tolist()
        note = "" if dataset == "mtbench" else f"; no {dataset} figure for {method}"
        return Acceptance(method, "published default", positions=positions_from_lengths(ks, lengths),
                          source=f"vLLM issue #20780, {method} on MT-Bench in vLLM V1, AL {lengths[0]:g}..{lengths[-1]:g} "
                                 f"at k={ks[0]}..{ks[-1]}{note}{other}")
    if method in ("eagle", "ngram"):
        data = dataset if dataset != "mtbench" else "sharegpt"
        table = pd.read_csv(SPECDECODE_POSITIONS)
        rows = table[(table["dataset"] == data) & (table["method"] == method) & (table["sampling"] == "walk")]
        rows = rows[rows["k"] == rows["k"].max()].sort_values("position")
        rates = [float(r) for r in rows["p_accept_given_previous"]]
        source = (f"SpecDecode-Bench (arXiv 2601.11580), {method} on {data} in vLLM 0.10.1.1, per-position rates at "
                  f"k={int(rows['k'].iloc[0])}{'; no mtbench figure for ngram' if data != dataset else ''}{other}")
        if method == "eagle":
            return Acceptance(method, "published default", positions=tuple(rates), source=source)
        match = rates[0] / rates[1]  # r_1 = m a_1 with a_1 = a_2 (module docstring)
        return Acceptance(method, "published default", positions=(rates[1], *rates[1:]), match_prob=round(match, 4),
                          source=source)
    return None


def assumed_default(method: str) -> Acceptance:
    """The simulator's default acceptance, labelled as the assumption it is."""
    return Acceptance(method, "assumed default", rate=ASSUMED_RATE,
                      source=f"no published acceptance for {method} ships with specsim: the simulator's "
                             f"--token-acceptance-prob {ASSUMED_RATE:g}; give --acceptance-length {method}=AL@K")


@dataclass
class AcceptanceInputs:
    """The acceptance flags, parsed: method -> (length, k), method -> result file, method -> trace file."""

    lengths: dict[str, tuple[float, int]] = field(default_factory=dict)
    results: dict[str, str] = field(default_factory=dict)
    traces: dict[str, str] = field(default_factory=dict)
    dataset: str = "sharegpt"


def _method_item(flag: str, item: str, default: str | None = None) -> tuple[str, str]:
    name, sep, value = item.partition("=")
    if not sep:
        if default is None:
            raise UserError(f"{flag}: expected METHOD=VALUE (e.g. eagle3=...), got {item!r}")
        return default, item
    return method_name(name.strip(), flag), value.strip()


def parse_acceptance_flags(lengths: list[str] | None, results: list[str] | None, traces: list[str] | None,
                           dataset: str, single_method: str | None) -> AcceptanceInputs:
    """``--acceptance-length METHOD=AL[@K]``, ``--acceptance-results METHOD=FILE``, ``--acceptance-trace
    [METHOD=]FILE`` (METHOD may be left out when one drafter is priced: ``single_method``)."""
    out = AcceptanceInputs(dataset=dataset)
    if dataset not in DATASETS:
        raise UserError(f"--acceptance-dataset: one of {', '.join(DATASETS)}, got {dataset!r}")
    for item in lengths or []:
        method, value = _method_item("--acceptance-length", item)
        raw, _, k = value.partition("@")
        try:
            length, at = float(raw), int(k) if k else DEFAULT_AL_K
        except ValueError:
            raise UserError(f"--acceptance-length: expected METHOD=AL or METHOD=AL@K (e.g. eagle3=3.1@3), got "
                            f"{item!r}") from None
        if at < 1:
            raise UserError(f"--acceptance-length: K must be >= 1, got {item!r}")
        leviathan_rate(length, at, f"--acceptance-length {item}")
        out.lengths[method] = (length, at)
    for item in results or []:
        method, path = _method_item("--acceptance-results", item)
        out.results[method] = path
    for item in traces or []:
        method, path = _method_item("--acceptance-trace", item, single_method)
        out.traces[method] = path
    for method in set(out.lengths) & set(out.results) | set(out.lengths) & set(out.traces) | \
            set(out.results) & set(out.traces):
        raise UserError(f"{method}: its acceptance is given twice (--acceptance-length, --acceptance-results, "
                        "--acceptance-trace): give one")
    return out


def from_results(method: str, path: str, base: Acceptance | None) -> Acceptance:
    """The acceptance in a vLLM result file's speculative counters (module docstring, item 2)."""
    from simulator.studies.vllm_io import PER_POSITION_KEY, read_vllm_result

    data = read_vllm_result(path, replay=False)
    drafts, tokens = data.get("spec_decode_num_drafts"), data.get("spec_decode_draft_tokens")
    if not drafts or not tokens:
        raise UserError(f"--acceptance-results {path}: no speculative counters (spec_decode_num_drafts and "
                        "spec_decode_draft_tokens, written by vllm bench serve with speculation on in newer vLLM)")
    match = base.match_prob if base is not None else None
    rates = data.get(PER_POSITION_KEY)
    if rates:
        positions, before = [], 1.0
        for r in rates:
            positions.append(min(1.0, r / before) if before > 0 else 0.0)
            before = r
        return Acceptance(method, "vLLM counters", positions=tuple(positions), match_prob=match,
                          source=f"{Path(path).name}: {PER_POSITION_KEY} {', '.join(f'{r:g}' for r in rates)}")
    k = round(tokens / drafts)
    length = float(data.get("spec_decode_acceptance_length") or 1 + data["spec_decode_accepted_tokens"] / drafts)
    rate = leviathan_rate(length, max(k, 1), f"--acceptance-results {path}")
    return Acceptance(method, "vLLM counters", rate=rate, match_prob=match,
                      source=f"{Path(path).name}: acceptance length {length:.3g} at k={k} -> a = {rate:.3f} (Leviathan)")


def resolve(methods: Iterable[str], target: str, inputs: AcceptanceInputs) -> dict[str, Acceptance]:
    """Each method's :class:`Acceptance`, by the order of the module docstring."""
    from simulator.inputs.acceptance import fit_acceptance, read_acceptance_trace

    out: dict[str, Acceptance] = {}
    methods = list(methods)
    for flag, given in (("--acceptance-length", inputs.lengths), ("--acceptance-results", inputs.results),
                        ("--acceptance-trace", inputs.traces)):
        for method in given:
            if method not in methods:
                raise UserError(f"{flag} {method}: no profile here prices {method} (priced: {', '.join(methods)})")
            if flag != "--acceptance-length" and not Path(given[method]).is_file():
                raise UserError(f"{flag} {method}={given[method]}: file not found")
    for method in methods:
        published = published_default(method, target, inputs.dataset)
        match = published.match_prob if published is not None else None
        if method in inputs.lengths:
            length, k = inputs.lengths[method]
            rate = leviathan_rate(length, k, "--acceptance-length")
            out[method] = Acceptance(method, "given", rate=rate, match_prob=match,
                                     source=f"--acceptance-length {method}={length:g}@{k} -> a = {rate:.3f} "
                                            "(Leviathan: AL = (1 - a^(k+1)) / (1 - a))")
        elif method in inputs.results:
            out[method] = from_results(method, inputs.results[method], published)
        elif method in inputs.traces:
            path = inputs.traces[method]
            positions = fit_acceptance(read_acceptance_trace(path))["positions"]
            out[method] = Acceptance(method, "acceptance trace", positions=tuple(round(p, 4) for p in positions),
                                     match_prob=match, trace=path, source=f"{Path(path).name}, replayed")
        else:
            out[method] = published if published is not None else assumed_default(method)
    return out
