"""Sliding-window attention layers (Beltagy et al., Longformer, arXiv 2004.05150; Gemma-2, gpt-oss): a query sees at
most ``window`` tokens, itself included (Hugging Face's count: Gemma-2's 4096 is 4095 tokens of left context).

Which layers slide: a config's ``layer_types`` (``sliding_attention`` / ``full_attention``, gpt-oss publishes it);
else the model type's rule: Gemma-2 slides its even layers (transformers ``modeling_gemma2.py``: ``sliding_window if
not bool(layer_idx % 2)``), Qwen2/3 the layers from ``max_window_layers`` on when ``use_sliding_window`` is true,
Mixtral every layer when ``sliding_window`` is set.

What a sliding layer costs: attention over at most ``window - 1`` cached tokens (:func:`attended_context`), and a KV
cache that keeps only the window. vLLM's hybrid KV-cache manager (``SlidingWindowManager.remove_skipped_blocks``,
``profiles/data/moe_speculation/architecture_notes.md`` sec. 1) frees every block wholly before ``computed - window +
1``, so a sequence holds its last ``window - 1`` tokens plus those scheduled in the step, plus at most one block where
the window starts mid-block; the simulator's block count applies that rule per request
(:class:`simulator.core.memory.KVLayout`), the roofline's fit check its token count (:func:`held_tokens`).
"""
from __future__ import annotations

from collections.abc import Callable

from profiles.architectures.base import Config

LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def layer_windows(config: Config, layers: int, slides: Callable[[int], bool] | None) -> list[int | None]:
    """Each layer's window (None: full attention): by ``layer_types`` if the config has it, else by ``slides`` (the
    model type's rule: layer index -> whether it slides; None: the type has no sliding layers)."""
    types = config.get("layer_types")
    if types is None and slides is None:
        return [None] * layers
    if types is not None:
        if not isinstance(types, list) or len(types) != layers or any(t not in LAYER_TYPES for t in types):
            raise config.refuse("layer_types", f"must list {layers} layers, each one of {', '.join(LAYER_TYPES)}")
        sliding = [LAYER_TYPES[t] for t in types]
    else:
        sliding = [slides(i) for i in range(layers)]
    window = config.size("sliding_window") if any(sliding) else None
    return [window if s else None for s in sliding]


def attended_context(context_len: int, window: int | None) -> int:
    """Cached tokens the first new token of a pass attends to in a layer of ``window`` (all of them without one)."""
    return context_len if window is None else min(context_len, window - 1)


def held_tokens(tokens: int, new: int, window: int | None) -> int:
    """Tokens of a sequence of ``tokens`` (``new`` of them scheduled in this pass) a layer of ``window`` keeps."""
    return tokens if window is None else min(tokens, window - 1 + new)
