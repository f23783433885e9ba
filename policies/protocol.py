"""What the simulated and the real engine must agree on about a step, written once.

Both engines (:mod:`simulator.core.engine` and :mod:`profiles.serving.engine`) schedule, ask the policy and
reserve KV room through these functions, so the simulator predicts the engine it claims to model:

- :data:`PROPOSERS`: who proposes the speculative tokens (a draft model, or n-gram prompt lookup);
- :func:`is_speculative`: whether a policy may ever propose (then the draft's memory and prefill count);
- :func:`lookahead`: the KV slots a decode step may write beyond a request's context;
- :func:`checked_proposal`: a policy's answer checked, with one message for both engines;
- :func:`admit_fcfs`: FCFS admission of waiting requests into a prefill step (vLLM v0's prefill-first);
- :func:`draft_lag`: how many context tokens the draft model has not seen after a decode step (the catch-up its
  next pass feeds), or, by the engine's rule (:data:`DRAFT_EXTENDS`, :func:`draft_feed`), what its first pass feeds.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

import numpy as np

from policies.errors import UserError

#: ``draft``: a draft model proposes (k sequential draft passes); ``ngram``: prompt lookup, no model.
PROPOSERS = ("draft", "ngram")


def is_speculative(policy_name: str, k: int) -> bool:
    """Whether a policy named ``policy_name`` with proposal bound ``k`` may ever propose tokens."""
    return k > 0 and policy_name != "no-spec"


def lookahead(max_k: int, speculative: bool) -> int:
    """KV slots one decode step may write beyond a request's context: the k proposed tokens (a token tree's k nodes,
    :mod:`policies.tree`: each verified node writes its slot) plus the one verified after them when speculating, else
    the one new token."""
    return max_k + 1 if speculative else 1


def checked_proposal(policy_name: str, k: object, batch_size: int, max_k: int) -> list[int]:
    """``k`` (a policy's :meth:`propose` answer) as a list of ints if it is an integer array of ``batch_size``
    values in ``[0, max_k]``; otherwise a :class:`UserError` naming the policy and what it returned. (A plain list:
    at batch sizes of tens the engines' per-step work is faster on lists than on small arrays.)"""
    if not isinstance(k, np.ndarray) or k.shape != (batch_size,):
        raise UserError(f"policy {policy_name}: propose() must return an int array of length {batch_size}, "
                        f"got {type(k).__name__} {getattr(k, 'shape', '')}")
    if k.dtype.kind not in "iu":
        raise UserError(f"policy {policy_name}: propose() must return integers, got dtype {k.dtype}")
    values = k.tolist()  # plain Python: at batch sizes of tens, faster than numpy's reductions
    if values and (min(values) < 0 or max(values) > max_k):
        raise UserError(f"policy {policy_name}: proposed k outside [0, {max_k}] (got {min(values)}..{max(values)})")
    return values


def admit_fcfs(waiting: deque[int], seats: int, budget: int, tokens_of: Callable[[int], int],
               reserve: Callable[[int, int], bool]) -> list[int]:
    """Admit waiting requests, first come first served with no skipping, into one prefill step.

    The head of ``waiting`` is admitted while ``seats`` (running-request slots) last and its ``tokens_of(rid)``
    prompt tokens fit the step's token ``budget`` (``max_num_batched_tokens``; a longer prompt is admitted alone,
    as the first of its step) and ``reserve(rid, tokens)`` agrees (it takes the KV room; an engine without a
    block limit always agrees). Admitted requests leave ``waiting``; returns them in order.
    """
    admitted: list[int] = []
    while waiting and seats > 0:
        rid = waiting[0]
        tokens = tokens_of(rid)
        if (tokens > budget and admitted) or not reserve(rid, tokens):
            break
        waiting.popleft()
        admitted.append(rid)
        budget -= tokens
        seats -= 1
    return admitted


def draft_lag(lag: int, k: int, accepted: int) -> int:
    """Tokens of a request's context that its draft model has not seen after a decode step in which it had ``lag``
    unseen, proposed ``k`` and had ``accepted`` of them accepted (a prefill leaves 1: the first output token).

    The draft's k passes fed it the unseen tokens and proposals 1..k-1. After the step it has not seen the token the
    target emitted after the accepted ones (the correction, or the bonus) and, when all k were accepted, the last
    proposal: 1 + [accepted == k]. Without a proposal (k = 0) it saw nothing: one more. The next draft pass feeds
    them all (:func:`policies.step_time.catchup_step_seconds` prices it). The real engine runs every draft pass over
    the whole batch, so there a request that proposed 0 beside others that proposed is fed too (lag 1).

    A token tree (:mod:`policies.tree`) is asked with ``k`` its depth: its passes fed every node with children, so the
    draft has not seen the bonus token and, when the accepted path ends at a leaf, that leaf; a path that ends at the
    tree's full depth surely does, and one that ends higher is taken to end at a node with children (an approximation:
    a tree's shorter branches end in leaves too; only the accepted length is drawn, not the path).
    """
    if k == 0:
        return lag + 1
    return 2 if accepted == k else 1


#: What the drafter's first pass of a step feeds each request (a profile's ``draft_extend``; :func:`draft_feed`):
#: ``unseen``, the tokens its draft has not seen (:func:`draft_lag`: a draft model keeping its own KV of its
#: proposals; this project's real engine; the default); ``accepted``, the tokens the target just emitted, accepted ones
#: and the bonus (vLLM 0.10 V1's EAGLE proposer, which recomputes the head's KV of the verified positions from the
#: target's hidden states, and its draft-model proposer with ``disable_padded_drafter_batch``); ``padded``, every
#: token the target just verified, k + 1 (a tree: its depth + 1), the rejected ones as padding (vLLM >= 0.11's padded
#: drafter batch, the default; SGLang 0.5's draft-extend pass, run as a CUDA graph of ``speculative_num_steps + 1``
#: tokens a request).
DRAFT_EXTENDS = ("unseen", "accepted", "padded")


def draft_feed(rule: str, lag: int, k: int, accepted: int) -> int:
    """Tokens the drafter's first pass feeds a request at its next step, after a step in which it fed ``lag``, proposed
    ``k`` (a token tree: its depth) and had ``accepted`` accepted, by the engine's ``rule`` (:data:`DRAFT_EXTENDS`).

    vLLM 0.10 (``vllm/v1/worker/gpu_model_runner.py``, ``propose_draft_token_ids``; ``vllm/v1/spec_decode/eagle.py``,
    ``prepare_inputs``) drops each request's rejected tokens from the tokens it scheduled and runs the head's first pass
    over the rest, ``k + 1 - rejected = accepted + 1``; a request that proposed nothing feeds its one new token (also
    accepted + 1, with accepted 0). Later versions pad the pass to every scheduled token; SGLang 0.5's
    ``EAGLEDraftExtendCudaGraphRunner`` to ``speculative_num_steps + 1`` a request."""
    if rule == "accepted":
        return accepted + 1
    if rule == "padded":
        return k + 1
    return draft_lag(lag, k, accepted)

