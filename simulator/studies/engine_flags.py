"""The engines' speculative flags, in and out: vLLM's ``--speculative-config`` JSON and SGLang's ``--speculative-*``
flags written from a speculation configuration of this simulator, and vLLM's JSON read back into one.

One parser (:func:`parse_speculative_config`) serves ``simulate --speculative-config`` and ``sweep
--speculative-config`` and is tested as the inverse of what ``advise`` writes (:func:`vllm_speculative_config`).

vLLM's keys (``vllm/config/speculative.py``, ``SpeculativeConfig``), and what each becomes here:

- ``method``: the speculative method (``draft_model``, ``eagle``, ``eagle3``, ``mtp``, ``ngram``) ->
  ``speculative_method``; absent, the profile's draft method (vLLM tells it from the model);
- ``model``: the draft model or head. It must be the profile's draft (its config name, e.g. ``eagle3-llama-3.1-8b``,
  or the Hugging Face name the shipped config records, e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``, or a folder of
  that name): the profile prices that draft's passes, so another name is refused;
- ``num_speculative_tokens`` -> ``k`` (with a table, the bound every step's k is clamped to, as vLLM's);
- ``speculative_token_tree`` -> ``speculative_token_tree`` (vLLM's string of rank paths, or the same as a JSON list);
- ``num_speculative_tokens_per_batch_size`` (vLLM PR #32374, "Dynamic SD"): a list of inclusive batch-size ranges
  ``[[start, end, k], ...]`` -> the ``vllm-batch-table`` policy with that table (:mod:`policies.batch_table`); without
  it the policy is ``fixed-k`` (vLLM's static k);
- ``prompt_lookup_min`` / ``prompt_lookup_max`` (``ngram``): read and checked, not modelled: the simulator's n-gram
  proposer finds a continuation with ``ngram_match_prob`` whatever the window.

Any other key is refused with one line naming it. SGLang's flags (``--speculative-algorithm``,
``--speculative-num-steps``, ``--speculative-eagle-topk``, ``--speculative-num-draft-tokens``,
``--speculative-draft-model-path``, ``--speculative-adaptive``) are written, not read (SGLang's names are this
simulator's own flags already).
"""
from __future__ import annotations

import json
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policies.batch_table import parse_table
from policies.draft_head import DEFAULT_DRAFT_METHOD, SGLANG_ALGORITHMS, method_name
from policies.errors import UserError
from policies.params import ParamReader

FLAG = "--speculative-config"
#: vLLM's ``speculative_config`` keys this reads (module docstring).
KEYS = ("method", "model", "num_speculative_tokens", "speculative_token_tree", "num_speculative_tokens_per_batch_size",
        "prompt_lookup_min", "prompt_lookup_max")
TABLE_KEY = "num_speculative_tokens_per_batch_size"
#: The config fields a speculative config sets (all of them, so a parsed config replaces what was there).
FIELDS = ("policy", "k", "policy_params", "speculative_method", "speculative_token_tree")
#: vLLM's n-gram window written for an n-gram configuration: ``prompt_lookup_max`` 4 as vLLM's n-gram documentation's
#: example (docs.vllm.ai, features/speculative_decoding/n_gram), ``prompt_lookup_min`` 2 as vLLM PR #24049's test plan.
#: Not modelled (module docstring): the window is the user's to tune.
NGRAM_WINDOW = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
#: SGLang's names of vLLM's methods (:data:`policies.draft_head.SGLANG_ALGORITHMS` inverted).
SGLANG_NAMES = {vllm: sglang for sglang, vllm in SGLANG_ALGORITHMS.items()}
#: The models' shipped configs, whose ``_name_or_path`` names a draft's published model (a data file, read only).
MODEL_CONFIGS = Path(__file__).resolve().parents[2] / "profiles" / "models"


def published_name(config_name: str | None) -> str | None:
    """The Hugging Face name a shipped model config records (``profiles/models/<name>.json``'s ``_name_or_path``), or
    None when there is no such file or name."""
    if not config_name:
        return None
    path = MODEL_CONFIGS / f"{config_name}.json"
    try:
        name = json.loads(path.read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return name if isinstance(name, str) and name else None


def draft_names(config_name: str | None) -> tuple[str, ...]:
    """The names a profile's draft answers to: its config name and the published name of that config."""
    return tuple(n for n in dict.fromkeys((config_name, published_name(config_name))) if n)


def _matches(model: str, names: tuple[str, ...]) -> bool:
    """``model`` is one of ``names`` (case aside), or a path whose last part is one's last part."""
    wanted = {n.lower() for n in names} | {n.rstrip("/").split("/")[-1].lower() for n in names}
    return model.lower() in wanted or model.rstrip("/").split("/")[-1].lower() in wanted


def _whole(key: str, value: Any, low: int) -> int:
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= low):
        raise UserError(f"{FLAG}: {key}: a whole number >= {low}, got {value!r}")
    return value


def table_text(entries: list[list[int]] | list[tuple[int, int, int]]) -> str:
    """vLLM's table ``[[start, end, k], ...]`` as the policy's string ``start-end:k,...``."""
    return ",".join(f"{s}-{e}:{k}" for s, e, k in entries)


def table_ranges(text: str, last: int) -> list[list[int]]:
    """The policy's table string (``start:k`` or ``start-end:k`` entries) as vLLM's ``[[start, end, k], ...]``: each
    entry's range ends before the next starts (vLLM's carry-forward, the same lookup), the last at ``last``."""
    entries = parse_table(ParamReader("vllm-batch-table", {}), text)
    return [[start, (entries[i + 1][0] - 1) if i + 1 < len(entries) else max(last, start), k]
            for i, (start, k) in enumerate(entries)]


def parse_speculative_config(text: str, profile_draft: str | None, profile_method: str) -> dict[str, Any]:
    """vLLM's ``--speculative-config`` JSON as this simulator's config fields (:data:`FIELDS`, module docstring).
    ``profile_draft``: the config name of the profile's draft (None: it names none); ``profile_method``: the method its
    draft rows price. A bad value or an unknown key is one :class:`UserError` line naming it."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise UserError(f"{FLAG}: not JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{FLAG}: a JSON object of vLLM's speculative_config keys, got {text!r}")
    for key in data:
        if key not in KEYS:
            raise UserError(f"{FLAG}: unknown key {key!r} (read here: {', '.join(KEYS)})")
    method = method_name(str(data["method"]), f"{FLAG}: method") if "method" in data else profile_method
    out: dict[str, Any] = {"speculative_method": method, "speculative_token_tree": None}
    model = data.get("model")
    if method == "ngram":
        if model is not None:
            raise UserError(f"{FLAG}: model {model!r}: an n-gram lookup has no draft model")
    elif model is not None:
        names = draft_names(profile_draft)
        if not isinstance(model, str) or not names or not _matches(model, names):
            shown = " or ".join(repr(n) for n in names) if names else "no draft in its metadata"
            raise UserError(f"{FLAG}: model {model!r} is not the profile's draft ({shown}): the profile prices that "
                            "draft's passes; give a profile of this draft")
    if "num_speculative_tokens" not in data:
        raise UserError(f"{FLAG}: num_speculative_tokens is required (vLLM requires it)")
    out["k"] = _whole("num_speculative_tokens", data["num_speculative_tokens"], 1)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if key in data:
            if method != "ngram":
                raise UserError(f"{FLAG}: {key} is the n-gram lookup's window; method is {method}")
            _whole(key, data[key], 1)
    if data.get("prompt_lookup_min", 1) > data.get("prompt_lookup_max", data.get("prompt_lookup_min", 1)):
        raise UserError(f"{FLAG}: prompt_lookup_min {data['prompt_lookup_min']} is above prompt_lookup_max "
                        f"{data['prompt_lookup_max']}")
    tree = data.get("speculative_token_tree")
    if tree is not None:
        if isinstance(tree, list):
            tree = "[" + ", ".join(str(tuple(p)) if isinstance(p, list) else repr(p) for p in tree) + "]"
        if not isinstance(tree, str):
            raise UserError(f"{FLAG}: speculative_token_tree: vLLM's string of rank paths, e.g. \"[(0,), (1,), (0, 0)]\"")
        out["speculative_token_tree"] = tree
    if TABLE_KEY in data:
        table = data[TABLE_KEY]
        if not isinstance(table, list):
            raise UserError(f"{FLAG}: {TABLE_KEY}: a list of inclusive ranges [[start, end, k], ...] (vLLM PR #32374), "
                            f"got {table!r}")
        try:
            entries = parse_table(ParamReader("vllm-batch-table", {}), table)
        except UserError as exc:
            problem = str(exc).split(": ", 1)[-1].removeprefix("parameter table ")
            raise UserError(f"{FLAG}: {TABLE_KEY}: {problem}") from None
        ends = [r[1] for r in sorted(table, key=lambda r: r[0])]
        out.update(policy="vllm-batch-table", policy_params=(("table", table_text(
            [(start, end, k) for (start, k), end in zip(entries, ends)])),))
    else:
        out.update(policy="fixed-k", policy_params=())
    return out


def vllm_speculative_config(fields: Mapping[str, Any], draft: str | None, max_batch: int) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` of a speculation configuration (config fields: ``policy``, ``k``,
    ``policy_params``, ``speculative_method``, ``speculative_token_tree``), the draft named by its published name;
    ``max_batch`` ends the last range of a table (vLLM carries it forward anyway). None when vLLM has no such setting
    (no speculation; SGLang's adaptive tiers; SmartSpec's goodput policy)."""
    policy = fields["policy"]
    if policy not in ("fixed-k", "vllm-batch-table"):
        return None
    method = fields["speculative_method"]
    out: dict[str, Any] = {"method": method}
    if method != "ngram":
        out["model"] = published_name(draft) or draft
    out["num_speculative_tokens"] = int(fields["k"])
    if fields.get("speculative_token_tree") is not None:
        out["speculative_token_tree"] = fields["speculative_token_tree"]
    if method == "ngram":
        out.update(NGRAM_WINDOW)
    if policy == "vllm-batch-table":
        out[TABLE_KEY] = table_ranges(str(dict(fields["policy_params"])["table"]), max_batch)
    return out


def sglang_flags(fields: Mapping[str, Any], draft: str | None) -> list[str] | None:
    """SGLang's ``launch_server`` flags of a speculation configuration, or None when SGLang has no such setting (no
    speculation; vLLM's per-batch-size table; SmartSpec's goodput policy). A chain of k is ``--speculative-num-steps
    k --speculative-eagle-topk 1 --speculative-num-draft-tokens k+1``; a tree its three numbers; SGLang's adaptive
    tiers ``--speculative-adaptive`` from the middle tier."""
    policy, method = fields["policy"], fields["speculative_method"]
    if policy not in ("fixed-k", "sglang-adaptive"):
        return None
    out = ["--speculative-algorithm", SGLANG_NAMES[method]]
    if method != "ngram":
        out += ["--speculative-draft-model-path", published_name(draft) or str(draft)]
    if fields.get("speculative_num_steps") is not None:
        steps, topk, tokens = (fields["speculative_num_steps"], fields["speculative_eagle_topk"],
                               fields["speculative_num_draft_tokens"])
    else:
        steps = 3 if policy == "sglang-adaptive" else int(fields["k"])  # the adaptive tiers' middle tier starts
        topk, tokens = 1, steps + 1
    if method == "ngram":
        out += ["--speculative-num-draft-tokens", str(tokens)]
    else:
        out += ["--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
                "--speculative-num-draft-tokens", str(tokens)]
    if policy == "sglang-adaptive":
        out.append("--speculative-adaptive")
    return out


def vllm_command(target: str, tp: int, config: dict[str, Any] | None) -> str:
    """``vllm serve TARGET --tensor-parallel-size TP [--speculative-config '{...}']``, quoted for a POSIX shell."""
    words = ["vllm", "serve", target, "--tensor-parallel-size", str(tp)]
    if config is not None:
        words += [FLAG, json.dumps(config, separators=(", ", ": "))]
    return shlex.join(words)


def sglang_command(target: str, tp: int, flags: list[str] | None, speculative: bool = True) -> str | None:
    """``python -m sglang.launch_server --model-path TARGET --tp TP FLAGS...``; None when speculation is asked for and
    SGLang has no such setting."""
    if flags is None and speculative:
        return None
    return shlex.join(["python", "-m", "sglang.launch_server", "--model-path", target, "--tp", str(tp), *(flags or [])])


def profile_draft(path: str) -> tuple[str | None, str]:
    """The config name of a profile's draft and the method its draft rows price, from its metadata (a coefficient
    JSON or a profile without metadata: no name, a draft model)."""
    from simulator.costs.profile_table import meta_path

    meta: Any = None
    if Path(path).suffix.lower() == ".csv" and meta_path(path).is_file():
        try:
            meta = json.loads(meta_path(path).read_text())
        except (OSError, ValueError):
            meta = None
    draft = meta.get("draft") if isinstance(meta, dict) else None
    if not isinstance(draft, dict):
        return None, DEFAULT_DRAFT_METHOD
    name = draft.get("config")
    return (name if isinstance(name, str) else None), str(draft.get("speculative_method", DEFAULT_DRAFT_METHOD))


def speculative_config_fields(text: str, data: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, Any]:
    """The config fields of ``--speculative-config TEXT`` (:func:`parse_speculative_config`) for the config ``data``
    resolved so far (its profile's draft checks ``model``); a field also given by its own flag (``given``) is refused:
    the speculation is said once."""
    from simulator.config import DEFAULT_SIM_PROFILE, flag

    for name in (*FIELDS, "proposer", "speculative_num_steps", "speculative_eagle_topk",
                 "speculative_num_draft_tokens"):
        if name in given:
            raise UserError(f"{FLAG} and {flag(name)}: give the speculation once ({FLAG} sets {', '.join(FIELDS)})")
    config_name, method = profile_draft(str(data.get("profile") or DEFAULT_SIM_PROFILE))
    return parse_speculative_config(text, config_name, method)
