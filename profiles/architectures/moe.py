"""Mixture-of-experts feed-forward blocks (Mixtral, Qwen3-MoE, DeepSeek-V3, GLM-4.5, gpt-oss): a router picks the
top ``top_k`` of ``experts`` gated MLPs (each ``expert_intermediate`` wide) per token; DeepSeek's and GLM's blocks add
shared experts every token passes through.

**Pricing a pass** (MoESD, Huang et al., arXiv 2505.19645, sec. 3: verifying k + 1 tokens per sequence wakes more
experts than decoding one). One pass of T tokens through one MoE layer:

- reads the weights of every *woken* expert once (a fused MoE kernel, vLLM's ``fused_moe``, runs each expert that
  has tokens over all of them) plus the router's and the shared experts' -- memory is held by all parameters,
  bandwidth spent on the woken ones;
- computes 2 x T x top_k x (one expert's parameters) FLOPs in the experts, 2 x T x (shared) in the shared experts.

The expected number of distinct experts T tokens wake (:func:`woken_experts`), each token choosing top_k of E without
replacement: with uniform routing a given expert is in a token's choice with probability C(E-1, k-1) / C(E, k) = k/E,
tokens independently, so it stays asleep with probability (1 - k/E)^T and, by linearity of expectation, exactly

    E[woken] = E (1 - (1 - k/E)^T)

(tests/test_moe.py checks it against enumeration of every routing). Routing is not uniform in practice: with
per-expert probabilities pi_i of being in a token's top-k (sum k), E[woken] = sum_i 1 - (1 - pi_i)^T, exact for
independent tokens whatever a token's joint choice. The skewed option draws pi from a Zipf law (pi_i proportional to
i^-s, capped at 1 and the rest refilled, as a top-k choice cannot pick an expert twice) whose exponent s is set so
that the **Gini coefficient of the per-expert load** is ``routing_gini`` (:func:`inclusion_probabilities`): the
measure :data:`ROUTING_GINI_SOURCE` reports from real traffic. Default 0: uniform (what load-balanced training aims
for, and MoESD's assumption).

**Expert parallelism** (``ep``: vLLM's ``--enable-expert-parallel`` over its tensor-parallel devices, SGLang's
``--ep-size``): the experts are spread whole over the ``ep`` devices (E/ep each) instead of being split ``tp`` ways;
a pass waits for the busiest device, so a device reads the expected **largest** number of woken experts any device
holds (experts placed round robin by popularity, as a balancing placement would; the devices' counts taken as
independent, each a Poisson-binomial of its experts' wake probabilities), and the tokens travel to their experts and
back by all-to-all (DeepEP's low-latency kernels: per token and layer top_k messages of 16 + hidden + hidden/32 bytes
with FP8 dispatch, 16 + 2 hidden with BF16, and top_k x 2 hidden to combine; a share (ep - 1)/ep of them leaves the
device; ``profiles/data/moe_speculation/architecture_notes.md``, sec. 3) in place of the tensor-parallel all-reduce of
the block's output. The attention stays tensor-parallel.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from policies.errors import UserError
from profiles.architectures.base import FeedForward, Matmul, divides

#: Where a realistic ``routing_gini`` comes from (the roofline's metadata records it).
ROUTING_GINI_SOURCE = (
    "Gini coefficient of the per-expert token load measured on real text by DODOCO (Ma et al., 'Diagnosing Overhead "
    "in Dispatch Operations', arXiv 2605.20982, H100s, EP 4-32): 0.105 for DeepSeek-MoE-16B (MHA) and 0.150 for "
    "Nemotron-30B (Mamba-2) on wikitext; DeepSeek-V2-Lite (MLA) and Qwen3.5-35B above 0.24 on every real-text "
    "condition; Qwen3-30B (GQA) between the two; random-token benchmarks overstate it up to 2.35x. Default 0: uniform "
    "routing")

#: DeepEP's message sizes per token and chosen expert (bytes; architecture_notes.md sec. 3): a control word, and the
#: hidden state in FP8 with one FP32 scale per 128 channels, or in BF16.
DISPATCH_CONTROL_BYTES = 16


def gini(values: np.ndarray) -> float:
    """The Gini coefficient of non-negative ``values`` (0: all equal; 1 - 1/n: one holds everything)."""
    x = np.sort(np.asarray(values, dtype=float))
    n = len(x)
    return float(2 * np.sum(np.arange(1, n + 1) * x) / (n * x.sum()) - (n + 1) / n)


def _capped(weights: np.ndarray, top_k: int) -> np.ndarray:
    """``weights`` scaled to sum ``top_k``, none above 1 (water-filling: the capped ones at 1, the rest rescaled)."""
    pi = np.zeros_like(weights)
    free = np.ones(len(weights), dtype=bool)
    while True:
        pi[free] = weights[free] * (top_k - (~free).sum()) / weights[free].sum()
        over = free & (pi > 1)
        if not over.any():
            return pi
        pi[over] = 1.0
        free &= ~over


@lru_cache(maxsize=None)
def _inclusion(experts: int, top_k: int, routing_gini: float) -> tuple[float, ...]:
    ranks = np.arange(1, experts + 1, dtype=float)
    if routing_gini == 0:
        return (top_k / experts,) * experts
    low, high = 0.0, 1.0
    while gini(_capped(ranks ** -high, top_k)) < routing_gini:
        high *= 2
    for _ in range(100):  # bisection on the Zipf exponent
        mid = (low + high) / 2
        low, high = (mid, high) if gini(_capped(ranks ** -mid, top_k)) < routing_gini else (low, mid)
    return tuple(_capped(ranks ** -((low + high) / 2), top_k).tolist())


def inclusion_probabilities(experts: int, top_k: int, routing_gini: float = 0.0) -> np.ndarray:
    """Each expert's probability of being among a token's ``top_k`` (sum ``top_k``, each <= 1), most popular first: a
    Zipf law whose load has Gini coefficient ``routing_gini`` (module docstring); uniform k/E at 0. The Gini of a top-k
    choice's load is below 1 - k/E (every token spreads over k experts)."""
    if not 0 <= routing_gini < 1 - top_k / experts:
        raise UserError(f"--routing-gini: must be in [0, {1 - top_k / experts:g}) for top-{top_k} of {experts} experts "
                        f"(got {routing_gini!r})")
    return np.array(_inclusion(experts, top_k, float(routing_gini)))


def woken_experts(tokens: int, experts: int, top_k: int, routing_gini: float = 0.0) -> float:
    """Expected distinct experts ``tokens`` tokens wake in one layer, each choosing ``top_k`` of ``experts``
    (module docstring): E (1 - (1 - k/E)^T) for uniform routing, sum_i 1 - (1 - pi_i)^T with skew."""
    if routing_gini == 0:
        return experts * (1 - (1 - top_k / experts) ** tokens)
    pi = inclusion_probabilities(experts, top_k, routing_gini)
    return float(np.sum(1 - (1 - pi) ** tokens))


@lru_cache(maxsize=4096)
def busiest_device_woken(tokens: int, experts: int, top_k: int, routing_gini: float, ep: int) -> float:
    """Expected largest number of woken experts on one of ``ep`` devices holding E/ep experts each, placed round robin
    by popularity (module docstring); ``woken_experts`` itself for ``ep`` 1."""
    if ep == 1:
        return woken_experts(tokens, experts, top_k, routing_gini)
    awake = 1 - (1 - inclusion_probabilities(experts, top_k, routing_gini)) ** tokens
    cdfs = []
    for device in range(ep):
        pmf = np.array([1.0])  # Poisson-binomial of the device's experts, by convolution
        for q in awake[device::ep]:
            pmf = np.convolve(pmf, [1 - q, q])
        cdfs.append(np.cumsum(pmf))
    most = min(len(c) for c in cdfs) - 1
    below = np.prod([c[:most] for c in cdfs], axis=0)  # P(every device has < m woken), m = 1..most
    return float(np.sum(1 - below))


@dataclass(frozen=True)
class MoE(FeedForward):
    hidden: int
    experts: int
    top_k: int
    expert_intermediate: int
    shared_intermediate: int = 0
    """Width of the shared experts together (``n_shared_experts x moe_intermediate_size``); 0: none."""
    expert_bias: bool = False
    """Biases on the experts' projections (gpt-oss)."""
    router_bias: bool = False
    """A bias per expert on the router's logits (gpt-oss's router bias, DeepSeek's ``e_score_correction_bias``)."""

    @property
    def expert_params(self) -> int:
        """One expert's weights: gate, up and down (and their biases)."""
        i = self.expert_intermediate
        return 3 * self.hidden * i + (2 * i + self.hidden if self.expert_bias else 0)

    @property
    def router_params(self) -> int:
        return self.experts * self.hidden + (self.experts if self.router_bias else 0)

    @property
    def shared_params(self) -> int:
        return 3 * self.hidden * self.shared_intermediate

    @property
    def params(self) -> int:
        return self.router_params + self.shared_params + self.experts * self.expert_params

    @property
    def active_params(self) -> float:
        return self.router_params + self.shared_params + self.top_k * self.expert_params

    def device_weights(self, tp: int) -> dict[str, float]:
        held = {"router": float(self.router_params), "experts": self.experts * self.expert_params / tp}
        return {**held, "shared_experts": self.shared_params / tp} if self.shared_params else held

    def matmuls(self, tokens: int, tp: int, ep: int, routing_gini: float) -> list[Matmul]:
        """Per device: the router (whole on every device), the shared experts (split ``tp`` ways), and the woken
        experts -- split ``tp`` ways, or whole on the ``ep`` devices, the busiest one's (module docstring)."""
        woken = busiest_device_woken(tokens, self.experts, self.top_k, routing_gini, ep)
        expert_weights = woken * self.expert_params / (tp if ep == 1 else 1)
        shared = self.shared_params / tp
        out = [Matmul("router", self.router_params, 2 * tokens * self.experts * self.hidden),
               Matmul("experts", expert_weights, 2 * tokens * self.top_k * self.expert_params / tp)]
        if shared:
            out.append(Matmul("shared_experts", shared, 2 * tokens * shared))
        return out

    def activation_elements(self, tp: int) -> float:
        """The router's logits, each token's hidden state gathered to and scattered back from its top_k experts
        (2 top_k hidden), and the experts' and shared experts' gate/up/activation/down-input widths (6 x intermediate
        per routed copy)."""
        return self.experts + 2 * self.top_k * self.hidden \
            + 6 * (self.top_k * self.expert_intermediate + self.shared_intermediate) / tp

    def all_to_all_bytes(self, tokens: int, ep: int, fp8_dispatch: bool) -> float | None:
        if ep == 1:
            return None
        dispatch = DISPATCH_CONTROL_BYTES + (self.hidden + self.hidden / 32 if fp8_dispatch else 2 * self.hidden)
        per_token = self.top_k * (dispatch + 2 * self.hidden)
        return tokens / ep * per_token * (ep - 1) / ep

    def check_parallel(self, tp: int, ep: int, where: str) -> None:
        if ep == 1:
            divides(tp, self.expert_intermediate, "the experts' intermediate size", where)
        else:
            divides(ep, self.experts, "the number of experts", where.replace("--tp", "--ep"))
        if self.shared_intermediate:
            divides(tp, self.shared_intermediate, "the shared experts' intermediate size", where)


def check_ep(ep: int, tp: int) -> None:
    """Expert parallelism spreads the experts over the tensor-parallel devices (vLLM: EP size = TP x DP, here DP 1;
    SGLang's ``--ep-size`` equal to ``--tp``)."""
    if isinstance(ep, bool) or not isinstance(ep, int) or ep not in (1, tp):
        raise UserError(f"--ep: must be 1 or the tensor-parallel degree {tp} (the experts spread over the --tp "
                        f"devices, vLLM's --enable-expert-parallel; got {ep!r})")

