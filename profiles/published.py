"""Published measurements of speculative decoding, in one CSV format (``profiles/data/README.md``).

A published table (a paper's figure read off, an issue's table transcribed) is one CSV file, one row per measured
point, with the columns of :data:`COLUMNS`: the engine and its version, the GPU and the tensor-parallel degree, the
target and the drafter, the speculative method and its k or tree, what "batch" means in that measurement
(:data:`BATCH_KINDS`) and its value, the dataset, the acceptance length when the source gives it, and the measured
figure (:data:`FIGURES`) with where it came from and how well it was read. Columns beyond these are kept and ignored
(a panel letter, a note). :func:`read_published` reads and checks a file; a bad cell stops with one line naming the
file, the line, the column and the value. ``run_sim.py calibrate --published`` fits a speculative cost model to such
files (:mod:`profiles.spec_calibrate`); ``calibrate --fit-draft-to`` reads their single-request TPOT rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from policies.errors import UserError
from profiles.models.config import resolve_model_config
from simulator.inputs.csv_checks import Column, finite_numbers, read_table, refuse_first, whole_numbers

#: The columns of a published table, in order (module docstring; ``profiles/data/README.md`` says what each holds).
COLUMNS = ("engine", "engine_version", "gpu", "num_gpus", "tp", "model", "method", "drafter",
           "num_speculative_tokens", "tree", "batch_kind", "batch_value", "dataset", "acceptance_length", "figure",
           "value", "read_error", "source", "how")
ENGINES = ("vllm", "sglang")
#: vLLM's speculative method names (SGLang's EAGLE / EAGLE3 / STANDALONE / NGRAM written as these); ``none``: the
#: same engine without speculation.
METHODS = ("none", "ngram", "eagle", "eagle3", "draft_model", "mtp")
#: What a row's batch is: ``offline_copies``, B identical prompts submitted together to the offline engine and run to
#: completion, one prompt after another (SpecDecode-Bench's batches, ``profiles/data/specdecode_bench/settings.md``);
#: ``concurrency``, ``vllm bench serve --max-concurrency``; ``request_rate``, requests per second of a serving run;
#: ``batch1``, one request at a time (value 1).
BATCH_KINDS = ("offline_copies", "concurrency", "request_rate", "batch1")
#: ``speedup`` (throughput with speculation over the same engine's without, the batch's own definition),
#: ``tpot_ms`` (mean time per output token after the first, milliseconds), ``throughput_tok_s`` (output tokens/s).
FIGURES = ("speedup", "tpot_ms", "throughput_tok_s")
#: Methods whose ``drafter`` names a model (a draft model or a head, resolved to a shipped config: :data:`CONFIGS`); an
#: n-gram row's ``drafter`` holds the lookup's settings as text, an MTP row's may name the layer or be empty.
MODEL_DRAFTERS = ("eagle", "eagle3", "draft_model")

#: Model names as sources write them (Hugging Face) -> the shipped config that describes their shape
#: (``profiles/models``). Meta-Llama-3-70B has Llama-3.1-70B's widths (they differ in rope scaling and context length,
#: which no cost reads); an Instruct model has its base model's.
CONFIGS = {
    "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3.1-70b",
    "Qwen/Qwen3-8B": "qwen3-8b",
    "yuhuili/EAGLE-LLaMA3.1-Instruct-8B": "eagle-llama-3.1-8b",
    "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B": "eagle3-llama-3.1-8b",
    "yuhuili/EAGLE-LLaMA3-Instruct-70B": "eagle-llama-3-70b",
    "AngelSlim/Qwen3-8B_eagle3": "eagle3-qwen3-8b",
    "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.2-1B": "llama-3.2-1b",
    "Qwen/Qwen3-0.6B": "qwen3-0.6b",
}


@dataclass(frozen=True)
class Tree:
    """A token tree as a row's ``tree`` cell gives it: SGLang's ``steps=S;topk=T;num_draft_tokens=N`` (``tree``
    empty: a chain of k)."""

    steps: int
    topk: int
    num_draft_tokens: int

    @classmethod
    def parse(cls, text: str, where: str) -> "Tree":
        fields: dict[str, int] = {}
        for part in text.split(";"):
            name, _, value = part.partition("=")
            if name.strip() not in ("steps", "topk", "num_draft_tokens") or not value.strip().isdigit() \
                    or int(value) < 1:
                raise UserError(f"{where} must be steps=S;topk=T;num_draft_tokens=N, whole numbers >= 1 "
                                f"(got {text!r})")
            fields[name.strip()] = int(value)
        if len(fields) != 3:
            raise UserError(f"{where} must give steps, topk and num_draft_tokens (got {text!r})")
        return cls(**fields)

    def __str__(self) -> str:
        return f"steps={self.steps};topk={self.topk};num_draft_tokens={self.num_draft_tokens}"


def config_name(name: str, where: str) -> str:
    """The shipped config (or config path) describing the model or drafter ``name`` (:data:`CONFIGS`, else ``name``
    itself as a shipped config name or a path: :func:`profiles.models.config.resolve_model_config`)."""
    if name in CONFIGS:
        return CONFIGS[name]
    resolve_model_config(name, where)
    return name


def read_published(path: str) -> list[dict[str, Any]]:
    """The rows of a published table, checked (module docstring), each a dict of :data:`COLUMNS` with numbers as
    numbers (``acceptance_length`` and ``read_error`` None where empty; ``tree`` a :class:`Tree` or None) and
    ``line`` (its line in the file, for messages)."""
    _, columns = read_table(path, {"published": COLUMNS})
    n = len(columns["value"].cells)
    text = {c: [cell.strip() for cell in columns[c].cells] for c in COLUMNS}
    for name, choices in (("engine", ENGINES), ("method", METHODS), ("batch_kind", BATCH_KINDS),
                          ("figure", FIGURES)):
        _choice(path, columns[name], choices)
    for name in ("engine_version", "gpu", "model", "dataset", "source", "how"):
        refuse_first(path, columns[name], np.array([not t for t in text[name]]), "must not be empty")
    num_gpus = whole_numbers(path, columns["num_gpus"], 1)
    tp = whole_numbers(path, columns["tp"], 1)
    refuse_first(path, columns["tp"], tp > num_gpus, "must be <= num_gpus")
    k = whole_numbers(path, columns["num_speculative_tokens"], 0)
    none = np.array([m == "none" for m in text["method"]])
    refuse_first(path, columns["num_speculative_tokens"], none & (k != 0), "must be 0 for method none")
    refuse_first(path, columns["num_speculative_tokens"], ~none & (k < 1), "must be >= 1 when speculating")
    refuse_first(path, columns["drafter"], np.array([m == "none" and bool(d) for d, m in zip(text["drafter"],
                                                                                          text["method"])]),
                 "must be empty for method none")
    refuse_first(path, columns["drafter"], np.array([m in MODEL_DRAFTERS and not d for d, m in zip(text["drafter"],
                                                                                                 text["method"])]),
                 f"must name the draft model or head for methods {', '.join(MODEL_DRAFTERS)}")
    batch = finite_numbers(path, columns["batch_value"])
    refuse_first(path, columns["batch_value"], batch <= 0, "must be > 0")
    single = np.array([b == "batch1" for b in text["batch_kind"]])
    refuse_first(path, columns["batch_value"], single & (batch != 1), "must be 1 for batch_kind batch1")
    copies = np.array([b in ("offline_copies", "concurrency") for b in text["batch_kind"]])
    refuse_first(path, columns["batch_value"], copies & (batch != np.floor(batch)), "must be a whole number of "
                                                                                    "requests")
    value = finite_numbers(path, columns["value"])
    refuse_first(path, columns["value"], value <= 0, "must be > 0")
    al = _optional(path, columns["acceptance_length"])
    read_error = _optional(path, columns["read_error"])
    refuse_first(path, columns["read_error"], read_error < 0, "must be >= 0")
    trees = [Tree.parse(t, f"{path}: line {i + 2}: tree") if t else None for i, t in enumerate(text["tree"])]
    depth = np.array([t.steps if t else kk for t, kk in zip(trees, k)])
    refuse_first(path, columns["acceptance_length"], (al < 1) | (al > depth + 1),
                 "must be in [1, k + 1] (a tree: its steps + 1)")
    rows = []
    for i in range(n):
        config_name(text["model"][i], f"{path}: line {i + 2}: model")
        if text["method"][i] in MODEL_DRAFTERS:
            config_name(text["drafter"][i], f"{path}: line {i + 2}: drafter")
        rows.append({**{c: text[c][i] for c in COLUMNS}, "num_gpus": int(num_gpus[i]), "tp": int(tp[i]),
                     "num_speculative_tokens": int(k[i]), "batch_value": float(batch[i]), "value": float(value[i]),
                     "acceptance_length": None if math.isnan(al[i]) else float(al[i]),
                     "read_error": None if math.isnan(read_error[i]) else float(read_error[i]),
                     "tree": trees[i], "line": i + 2})
    return rows


def _choice(path: str, column: Column, choices: tuple[str, ...]) -> None:
    refuse_first(path, column, np.array([c.strip() not in choices for c in column.cells]),
                 f"must be one of {', '.join(choices)}")


def _optional(path: str, column: Column) -> np.ndarray:
    """An optional number column: NaN where empty, else a finite number."""
    empty = np.array([not c.strip() for c in column.cells])
    filled = Column(column.name, [c if c.strip() else "0" for c in column.cells])
    values = finite_numbers(path, filled)
    values[empty] = np.nan
    return values


#: Columns of a step-time breakdown table (``specdecode_bench/fig4_breakdown.csv``: SpecDecode-Bench's Fig. 4): the
#: shares of a run's step time in drafting, verification, (rejection) sampling and other overhead, summing to 1.
BREAKDOWN_COLUMNS = ("engine", "engine_version", "gpu", "num_gpus", "model", "dataset", "method",
                     "num_speculative_tokens", "drafter", "batch_size", "frac_drafting", "frac_verification",
                     "frac_sampling", "frac_overhead")
SHARES = ("frac_drafting", "frac_verification", "frac_sampling", "frac_overhead")


def read_breakdown(path: str) -> list[dict[str, Any]]:
    """The rows of a step-time breakdown table (:data:`BREAKDOWN_COLUMNS`), checked: shares in [0, 1] summing to 1
    (within 0.01: read off a figure), batch sizes whole numbers >= 1; one line per problem."""
    _, columns = read_table(path, {"breakdown": BREAKDOWN_COLUMNS})
    _choice(path, columns["method"], METHODS)
    batch = whole_numbers(path, columns["batch_size"], 1)
    k = whole_numbers(path, columns["num_speculative_tokens"], 0)
    shares = {name: finite_numbers(path, columns[name]) for name in SHARES}
    for name, values in shares.items():
        refuse_first(path, columns[name], (values < 0) | (values > 1), "must be a share in [0, 1]")
    total = sum(shares.values())
    refuse_first(path, columns["frac_overhead"], np.abs(total - 1) > 0.01, "makes the four shares sum to other "
                                                                            "than 1")
    rows = []
    for i in range(len(batch)):
        row = {c: columns[c].cells[i].strip() for c in BREAKDOWN_COLUMNS}
        row.update({"batch_size": int(batch[i]), "num_speculative_tokens": int(k[i]), "line": i + 2,
                    **{name: float(shares[name][i]) for name in SHARES}})
        config_name(row["model"], f"{path}: line {i + 2}: model")
        rows.append(row)
    return rows
