"""The draft-head proposer family's names: vLLM's speculative methods, SGLang's algorithms, and who proposes for each.

A *draft head* (EAGLE, EAGLE-3, a model's own MTP layer) is a small network that runs on the target's hidden states
and proposes as a draft model does: k sequential passes per step, one token per sequence each (Li et al., EAGLE,
arXiv 2401.15077; EAGLE-3, arXiv 2503.01840; DeepSeek-V3's multi-token prediction, arXiv 2412.19437, sec. 2.2).
Both engines price those passes from the profile's ``draft`` rows, so a head is the ``draft`` proposer family with
another method name; what a head is made of (and so what its rows cost) is the profiles side's business
(:mod:`profiles.models.config`).

Names follow vLLM's ``--speculative-config`` ``method`` (:data:`SPECULATIVE_METHODS`); SGLang's
``--speculative-algorithm`` names (:data:`SGLANG_ALGORITHMS`) are accepted and mapped to them.
"""
from __future__ import annotations

from policies.errors import UserError

#: vLLM's speculative methods -> the proposer family that runs them (:data:`policies.protocol.PROPOSERS`):
#: ``draft`` (sequential draft passes priced by the profile's draft rows) or ``ngram`` (prompt lookup, no pass).
SPECULATIVE_METHODS = {"draft_model": "draft", "eagle": "draft", "eagle3": "draft", "mtp": "draft", "ngram": "ngram"}
#: The methods whose drafts come from a head on the target's hidden states (not a separate model).
HEAD_METHODS = ("eagle", "eagle3", "mtp")
#: SGLang's ``--speculative-algorithm`` names -> vLLM's method names (``EAGLE`` is EAGLE-2's drafting with an
#: EAGLE-1-shaped head, vLLM's ``eagle``).
SGLANG_ALGORITHMS = {"STANDALONE": "draft_model", "EAGLE": "eagle", "EAGLE3": "eagle3", "MTP": "mtp", "NGRAM": "ngram"}
#: The method a profile's draft rows describe when its metadata names none: a draft model (every profile before
#: heads existed).
DEFAULT_DRAFT_METHOD = "draft_model"


def method_name(value: str, where: str) -> str:
    """vLLM's name of a speculative method given by vLLM's or SGLang's name; anything else is a one-line UserError
    naming ``where``."""
    if value in SPECULATIVE_METHODS:
        return value
    if value in SGLANG_ALGORITHMS:
        return SGLANG_ALGORITHMS[value]
    raise UserError(f"{where}: unknown speculative method {value!r} (vLLM's {', '.join(SPECULATIVE_METHODS)}; "
                    f"SGLang's {', '.join(SGLANG_ALGORITHMS)})")


def proposer_of(method: str) -> str:
    """The proposer family (``draft`` or ``ngram``) that runs ``method`` (vLLM's or SGLang's name)."""
    return SPECULATIVE_METHODS[method_name(method, "speculative_method")]
