"""What every architecture family contributes to the one description (:class:`profiles.architectures.Architecture`):
an attention family (:mod:`.gqa`, :mod:`.mla`) and a feed-forward family (:mod:`.mlp`, :mod:`.moe`) per decoder layer,
each a frozen dataclass answering the same questions, and the readers' shared checks of a config's values.

A family answers, per token and layer, with counts, never seconds (the roofline, :mod:`profiles.analytical`, prices
them on a GPU):

- its weights: held (:attr:`params`, parameters), and per pass on one of ``tp`` devices (:meth:`matmuls`: the weights
  read and the FLOPs, by weight kind, :data:`WEIGHT_KINDS`);
- its activations through unfused kernels (:meth:`activation_elements`: elements per token read and written);
- an attention family also its KV cache (elements per token on one device, :meth:`kv_elements`) and the FLOPs and
  bytes of attention itself (:meth:`attention`); a feed-forward family what it sends between devices under expert
  parallelism (:meth:`FeedForward.all_to_all_bytes`; under tensor parallelism alone it ends in an all-reduce, as the
  attention does).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.errors import UserError

#: Kinds of weights a pass reads, each at its own precision (:mod:`.precision`): the attention projections, a dense
#: MLP's, the routed experts', the shared experts' and the router's (never quantized by the checkpoints read here).
WEIGHT_KINDS = ("attention", "mlp", "experts", "shared_experts", "router")


@dataclass(frozen=True)
class Matmul:
    """The projections of one weight kind in one pass on one device: ``weights`` parameters read (each once) and
    ``flops`` multiply-adds x 2."""

    kind: str
    weights: float
    flops: float


@dataclass(frozen=True)
class OpCost:
    """FLOPs and bytes of one operator class on one device (priced by the roofline)."""

    flops: float
    bytes: float


class Attention:
    """An attention family (interface; :mod:`.gqa`, :mod:`.mla`). Frozen dataclasses subclass it."""

    hidden: int
    heads: int

    @property
    def params(self) -> int:
        raise NotImplementedError

    def device_weights(self, tp: int) -> dict[str, float]:
        """Parameters held on one of ``tp`` devices, by weight kind."""
        raise NotImplementedError

    def matmuls(self, tokens: int, tp: int) -> list[Matmul]:
        raise NotImplementedError

    def kv_elements(self, tp: int = 1) -> int:
        """KV-cache elements one token holds in one layer on one of ``tp`` devices."""
        raise NotImplementedError

    def attention(self, phase: str, tokens: int, batch_size: int, mean_keys: float, kv_tokens: float, tp: int,
                  dtype_bytes: int) -> OpCost:
        """FLOPs and bytes of attention in one layer over ``tokens`` new tokens (``batch_size`` sequences) that each
        see ``mean_keys`` keys on average, reading ``kv_tokens`` cached tokens per sequence."""
        raise NotImplementedError

    def activation_elements(self) -> int:
        """Attention-width activation elements per token (split over the tensor-parallel devices)."""
        raise NotImplementedError

    def check_tp(self, tp: int, where: str) -> None:
        """Refuse a tensor-parallel degree the engine refuses (one line naming ``--tp``)."""
        raise NotImplementedError


class FeedForward:
    """A feed-forward family (interface; :mod:`.mlp`, :mod:`.moe`)."""

    @property
    def params(self) -> int:
        raise NotImplementedError

    @property
    def active_params(self) -> float:
        """Parameters one token computes with (a mixture of experts: its shared experts, router and top-k experts)."""
        return float(self.params)

    def device_weights(self, tp: int) -> dict[str, float]:
        """Parameters held on one of ``tp`` devices, by weight kind (the same with the experts spread whole over the
        ``tp`` devices, expert parallelism)."""
        raise NotImplementedError

    def matmuls(self, tokens: int, tp: int, ep: int, routing_gini: float) -> list[Matmul]:
        raise NotImplementedError

    def activation_elements(self, tp: int) -> float:
        """Activation elements per token through the block's unfused kernels on one of ``tp`` devices."""
        raise NotImplementedError

    def all_to_all_bytes(self, tokens: int, ep: int, fp8_dispatch: bool) -> float | None:
        """Bytes one device sends per pass to dispatch tokens to experts on other devices and combine their outputs
        (expert parallelism, :mod:`.moe`); None: the block's output is all-reduced over the tensor-parallel devices."""
        return None

    def check_parallel(self, tp: int, ep: int, where: str) -> None:
        """Refuse a tensor-/expert-parallel layout the engine refuses (one line naming ``where``)."""
        raise NotImplementedError


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its attention, feed-forward block, sliding window (tokens a query sees, itself included, as
    Hugging Face counts it; None: full attention) and RMSNorm vectors of hidden size (two in Llama's layer, four in
    Gemma-2's)."""

    attention: Attention
    ffn: FeedForward
    window: int | None = None
    norms: int = 2

    def params(self, hidden: int) -> int:
        return self.attention.params + self.ffn.params + self.norms * hidden

    def active_params(self, hidden: int) -> float:
        return self.attention.params + self.ffn.active_params + self.norms * hidden


@dataclass(frozen=True)
class Decoder:
    """What a model type's reader (:mod:`.hf`) makes of a config: the layers and the parts around them."""

    hidden: int
    vocab: int
    layers: tuple[Layer, ...]
    tied_embeddings: bool
    quantization: tuple[tuple[str, str], ...] = ()
    """The checkpoint's precision by weight kind (:mod:`.precision`; absent: bf16)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint ships beside the model (``num_nextn_predict_layers``): the draft
    head ``mtp`` of this target (not part of its passes)."""


class Config:
    """A parsed ``config.json`` read key by key: values checked, every error one line naming the file and key."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.data = data
        self.where = where

    def get(self, key: str, default: Any = None) -> Any:
        value = self.data.get(key)
        return default if value is None else value

    def size(self, key: str, default: int | None = None) -> int:
        """A positive integer (``default`` where the key is absent or null)."""
        value = self.get(key, default)
        if value is None:
            raise UserError(f"{self.where}: {key} missing")
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{self.where}: {key} must be a positive integer (got {value!r})")
        return value

    def count(self, key: str, default: int = 0) -> int:
        """An integer >= 0."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{self.where}: {key} must be an integer >= 0 (got {value!r})")
        return value

    def flag(self, key: str, default: bool = False) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.where}: {key} must be true or false (got {value!r})")
        return value

    def refuse(self, key: str, why: str) -> UserError:
        return UserError(f"{self.where}: {key} {self.data.get(key)!r}: {why}")


def divides(part: int, whole: int, what: str, where: str) -> None:
    """vLLM's ``divide``: ``whole`` must split evenly into ``part`` devices (one line naming ``where``)."""
    if whole % part:
        raise UserError(f"{where}: {part} does not divide {what} ({whole}); vLLM refuses it")
