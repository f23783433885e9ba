"""Analytical (roofline) profiles: forward-pass seconds computed from an architecture and a GPU datasheet.

A profile made here stands in for a measured one on hardware we cannot run on (A100, H100) and is a
cross-check where we can (H200). For one pass of ``batch_size`` sequences, each adding ``query_len``
tokens over ``context_len`` cached ones, the seconds are a roofline (Williams, Waterman and Patterson,
"Roofline", CACM 2009) per operator class, summed over the classes, plus the tensor-parallel
communication and the engine's per-pass overhead::

    t = sum_op max(FLOPs_op / (peak x eff_compute), bytes_op / (bw x eff_bw)) + t_comm + t_overhead
    t_overhead = overhead_fixed_s + overhead_per_layer_s x layers

where the matrix multiplications' compute efficiency may depend on the T tokens of the pass, eff(T) = eff_compute x
T / (T + T_half) (:func:`matmul_seconds`, ``Efficiency.compute_half_tokens``; 0, a constant efficiency, unless a
speculative calibration fitted it: :mod:`profiles.spec_calibrate`).

``t_overhead`` is what a pass costs beyond its kernels' work: launching (replaying) the pass, the gaps between
its small kernels, preparing inputs and reading the logits back; it dominates small models (a 68M draft pass)
and is a third of a 7B decode pass at batch 1. Its two terms and the efficiencies are fitted to the passes
measured on an H200 with this project's optimized forward (:data:`EFFICIENCY_SOURCE`,
``profiles/data/h200-optimized__*.csv``; :func:`fit_efficiency` refits them), so a profile made here for an A100
or H100 models that engine on that GPU.

The model is the one description every family reads into (:class:`profiles.architectures.Architecture`: grouped-query
or latent attention, full or sliding-window layers, dense or mixture-of-experts feed-forward blocks, from any
supported ``config.json``); the roofline sums what each layer kind contributes, once per kind, times its count.
The GPUs are ``profiles/data/gpus.csv``'s rows (:data:`GPUS`, each row's source recorded in a profile's metadata).

Weight precision (``weights`` for the target, ``draft_weights`` for the draft, :data:`WEIGHT_CHOICES`; ``auto``: as
the checkpoint's ``quantization_config`` stores them, DeepSeek-V3's block FP8, gpt-oss's MXFP4 experts): the
projections are read at their bytes per weight, scales included (:mod:`profiles.architectures.precision`), and
computed in fp8 (W8A8) where the GPU has FP8 tensor cores, in fp4 (NVFP4 W4A4) on Blackwell, MXFP4 at the FP8 rate
on Blackwell, else dequantized to bf16 (Marlin-style weight-only kernels; int8 and int4 always so). A low-precision
matmul's FLOPs count as bf16 FLOPs times the ratio of the two rates. Embeddings, norms, the router and the LM head
stay bf16; KV stays ``dtype``.

with the operator classes

- ``linear`` (per layer kind): the attention projections and the feed-forward block's (gate/up/down; a mixture of
  experts' router, shared experts and the experts the pass wakes, :mod:`profiles.architectures.moe`). FLOPs = 2 x
  tokens x the parameters each token computes with; bytes = the weights read once per pass (of a mixture of
  experts: the expected woken experts', E (1 - (1 - k/E)^T) of E for T tokens routed top-k under uniform routing,
  MoESD, arXiv 2505.19645), plus the activations each unfused HF-style kernel reads and writes (15 hidden-size
  tensors a layer, plus the families' own widths).
- ``attention`` (per layer kind): FLOPs per (query, key) pair from the family (grouped-query: 4 x heads x head_dim;
  latent attention absorbed in decode, decompressed in prefill, :mod:`profiles.architectures.mla`), over
  query_len x (context + (query_len + 1) / 2) pairs per sequence (causal over the new tokens), the context a
  sliding-window layer's window at most; bytes: the cached K and V (or latent) read, depending on how the engine
  verifies (:data:`VERIFICATIONS`, recorded as ``verification`` in the metadata):
  * ``multi-query`` (modern engines: vLLM v1, SGLang, TensorRT-LLM; this project's real engine): the
    query_len new tokens of a sequence are queries of one attention call, so its K and V of all context
    and new tokens are read once, and the new ones written;
  * ``batch-expansion`` (vLLM v0's ``BatchExpansionTop1Scorer``, on which SmartSpec's fork was built):
    the query_len tokens become query_len single-token sequences over contexts context_len + j,
    j = 0..query_len - 1, each re-reading its cache: bytes = sum_j (context_len + j + 2) per sequence.
    Same FLOPs; a pass with query_len = 1 (a draft pass, plain decoding) costs the same either way.
- ``lm_head`` (once): logits for every new token of a decode/verify pass, for the last prompt token
  of a prefill (as vLLM does); the input embedding gather is folded in.

**Draft heads** (EAGLE, EAGLE-3, MTP; :data:`profiles.models.config.HEAD_SHAPES`) are priced by the same formula as
the ``draft`` role of a (target, head) profile: their decoder layer(s) as ``linear`` and ``attention`` (EAGLE-3's
q/k/v over [embedding, fc output], twice the hidden size), their fc layer as one more ``linear`` term a pass (weights
``fc_inputs x hidden x hidden``), and ``lm_head`` over the rows the head computes: the target's vocabulary for EAGLE
and MTP (the shared LM head is still read every pass), EAGLE-3's draft vocabulary (32,000 for Llama-3.1-8B's
published head, a quarter of the target's 128,256). An MTP head (``mtp.json``, no model type of its own) is the
target's last layer behind its projection: for DeepSeek-V3 one more MLA + mixture-of-experts block (its experts woken
by the draft pass's tokens), in the target's precision. A head's prefill is its layer over the prompt (vLLM's EAGLE
proposer runs the head over the prompt's tokens and the target's hidden states after the target's prefill); there
is no separate model to prefill. Its memory is its own weights (fc, layer, norms, EAGLE-3's LM head; the embedding,
and EAGLE's and MTP's LM head, are the target's) and one layer's KV per token. Approximation: EAGLE-3's fc runs once
a step in vLLM (over the target's fused states of the tokens just verified), but a profile row is one draft pass,
so every pass is priced with it: an upper bound by the fc's share of a pass (a tenth of an 8B head's weight reads)
on passes 2..k. The per-pass overhead is the engine's, as for a draft model's pass: ``overhead_fixed_s +
overhead_per_layer_s`` (one layer) here, and a calibrated profile's ``pass_overhead_s`` in full
(:func:`profiles.calibrate.transfer`; vLLM v0 ran EAGLE through the draft model runner).

A model too large for one GPU (Llama-3.1-70B in bf16 does not fit 80 GB) runs with tensor parallelism
of degree ``tp`` (Megatron-LM, Shoeybi et al. 2019, sec. 3): FLOPs, weights and KV heads split ``tp`` ways (where
the family does: latent attention's down-projections and cache stay whole on every device, KV heads fewer than
``tp`` are replicated; ``tp`` must divide the attention heads, as vLLM requires) and each layer adds two
all-reduces of the layer's activations (tokens x hidden x dtype bytes), ring all-reduce time ``latency + 2 (tp -
1) / tp x bytes / (link_bw x eff_link)`` (Patarasuk and Yuan 2009), plus an all-gather of the vocabulary-parallel
logits. With expert parallelism (``ep`` = ``tp``: vLLM's ``--enable-expert-parallel``, SGLang's ``--ep-size``) the
experts are spread whole over the devices, a pass waits for the device with the most woken experts, and the
feed-forward block's all-reduce becomes DeepEP's dispatch and combine all-to-all (:mod:`profiles.architectures.moe`).
A draft model runs unsharded on the first device (vLLM's ``speculative_draft_tensor_parallel_size = 1``), which
makes that device the one whose memory runs out first; a draft head (EAGLE, MTP) in the target's tensor-parallel
group, as vLLM's speculative config sizes it; ``Deployment.draft_tp`` = ``tp`` shards a draft model as the target
(vLLM V1 and SGLang run the drafter in the target's workers), paying its own all-reduces.

The roofline models an engine that appends to the KV cache in place (vLLM's paged cache; this project's optimized
forward); the HF ``DynamicCache`` of the eager measured profiles copies the whole cache on each pass, so those
exceed these at large batch x context. ``python -m profiles.analytical --out profiles/data`` regenerates the
shipped profiles; ``python -m profiles.analytical --gpu h200 --target llama-2-7b --draft llama-68m --weights int4
--out P.csv`` makes one (then ``run_sim.py simulate --profile P.csv``); ``--gpu h200 --tp 8 --target deepseek-v3
--draft mtp --enable-expert-parallel`` one of DeepSeek-V3 with experts spread over 8 GPUs.
"""
from __future__ import annotations

import argparse
import csv
import sys
from dataclasses import asdict, dataclass, replace
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from profiles.architectures import Architecture
from profiles.architectures.moe import ROUTING_GINI_SOURCE, check_ep
from profiles.architectures.precision import (WEIGHT_BYTES, WEIGHT_CHOICES, check_weights, compute_format,
                                              kind_precisions)
from profiles.architectures.sliding import attended_context, held_tokens
from profiles.grid import GPU_GRID, Grid
from profiles.models.config import HEAD_SHAPES, read_model_config
from policies.errors import FlagParser, UserError, exit_on_user_error
from simulator.costs.profile_table import VERIFICATIONS

DATA_DIR = Path(__file__).resolve().parent / "data"
GIB = 1024 ** 3

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


# -- hardware ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """Datasheet figures of one GPU (``profiles/data/gpus.csv``, its ``source`` column kept): dense tensor-core FLOP/s
    in bf16 (``peak_flops``), fp8 and fp4 (None: no such tensor cores), HBM bytes/s, memory GiB (the driver's figure
    where known, ``profiles/data/gpus.md``), scale-up link bytes/s per direction."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_gib: float
    link_bandwidth: float
    source: str
    fp8_flops: float | None = None
    fp4_flops: float | None = None
    link: str = ""

    @property
    def formats(self) -> frozenset[str]:
        """The low-precision tensor-core formats it has (of ``fp8``, ``fp4``)."""
        return frozenset(f for f, rate in (("fp8", self.fp8_flops), ("fp4", self.fp4_flops)) if rate)

    def peak(self, fmt: str) -> float:
        """Dense FLOP/s in ``fmt`` (``bf16``, ``fp8``, ``fp4``; one it has)."""
        return {"bf16": self.peak_flops, "fp8": self.fp8_flops, "fp4": self.fp4_flops}[fmt]


GPUS_CSV = DATA_DIR / "gpus.csv"
#: The dense bf16 rate the roofline's efficiencies were fitted against (:data:`EFFICIENCY_SOURCE`) and every shipped
#: H100/H200 profile was made with: 989 TFLOPS (aiconfigurator's rounding), kept; ``gpus.csv`` gives the datasheet's
#: 1,979 with sparsity / 2 = 989.5, 0.05% more.
FITTED_BF16_FLOPS = {"h100-80gb": 989e12, "h200": 989e12}


def read_gpus(path: Path = GPUS_CSV) -> dict[str, GPU]:
    """The GPUs of ``gpus.csv``, by key (its figures as written; memory: ``memory_gib_driver`` where filled, else
    ``memory_gib``)."""
    def number(text: str) -> float | None:
        return float(text) if text.strip() else None

    gpus = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            key = row["key"]
            fitted = f"; bf16 priced at {FITTED_BF16_FLOPS[key]:g} (the rate the efficiencies were fitted against, " \
                "FITTED_BF16_FLOPS)" if key in FITTED_BF16_FLOPS else ""
            gpus[key] = GPU(name=row["name"], peak_flops=FITTED_BF16_FLOPS.get(key, float(row["bf16_dense_flops"])),
                            hbm_bandwidth=float(row["hbm_bytes_per_s"]),
                            memory_gib=number(row["memory_gib_driver"]) or float(row["memory_gib"]),
                            link_bandwidth=float(row["link_bytes_per_s_per_direction"]),
                            source=f"profiles/data/gpus.csv: {row['source']}{fitted}",
                            fp8_flops=number(row["fp8_dense_flops"]), fp4_flops=number(row["fp4_dense_flops"]),
                            link=row["link_name"])
    return gpus


GPUS: dict[str, GPU] = read_gpus()


@dataclass(frozen=True)
class Efficiency:
    """Fractions of the datasheet peaks that the modelled engine's kernels reach (``compute``, ``bandwidth``;
    ``link``: NCCL all-reduce bus bandwidth over NVLink), the latency of one small collective, and the per-pass
    overhead ``overhead_fixed_s + overhead_per_layer_s x layers`` (module docstring). Sources:
    :data:`EFFICIENCY_SOURCE`."""

    compute: float = 0.47
    bandwidth: float = 0.64
    link: float = 0.75
    collective_latency_s: float = 10e-6
    overhead_fixed_s: float = 9e-5
    overhead_per_layer_s: float = 6.4e-5
    compute_half_tokens: float = 0.0
    """Tokens T_half at which a pass's matrix multiplications reach half of ``compute``: their efficiency over T tokens
    is ``compute x T / (T + T_half)`` (:func:`matmul_seconds`); 0: ``compute`` at every T (every profile made before
    speculative calibration, and the shipped analytical ones)."""

    roofline_exponent: float = 0.0
    """p of the smooth roofline ``(compute_s^p + memory_s^p)^(1/p)`` (:func:`_roofline`); 0: the hard
    ``max(compute_s, memory_s)`` (every profile made before speculative calibration, and the shipped analytical
    ones)."""

    def record(self) -> dict[str, float]:
        """The fields as a profile's metadata records them; ``compute_half_tokens`` and ``roofline_exponent`` only
        where set (0 is what a profile without them means: the metadata of every profile made before them stays as it
        was)."""
        return {k: v for k, v in asdict(self).items() if k not in ("compute_half_tokens", "roofline_exponent") or v}


#: Where the :class:`Efficiency` defaults come from (recorded in each profile's metadata).
EFFICIENCY_SOURCE = (
    "compute 0.47, bandwidth 0.64, overhead 90 us + 64 us per layer: least-squares fit (log ratio, each "
    "pair x role x phase weighted alike) to the 1,149 passes measured on an H200 with this project's optimized "
    "forward (in-place KV cache, CUDA graphs, fused q/k/v and gate/up; profiles/data/h200-optimized__*.csv, "
    "2026-11-30; fit_efficiency). Before the fit (datasheet-derived 0.80 / 0.90 from an 8192^3 matmul and a "
    "device copy, 300 us + 10 us per layer assumed) the analytical passes were 0.61x the measured target decode "
    "and 0.63x its prefill (median); after it, 1.02 / 1.08 (7B) and 1.03 / 1.16 (8B). Assumed alike on A100 and "
    "H100 (no such GPU measured here). link 0.75 and 10 us per collective: NCCL ring all-reduce on NVLink "
    "(nccl-tests)")


#: How a draft head's rows are priced (recorded in a head profile's metadata; the module docstring says why).
HEAD_PRICING = ("the head's passes by the roofline of its own layer(s), fc layer and LM head rows, plus the engine's "
                "per-pass overhead as any pass (a calibrated profile's pass_overhead_s in full); its prefill is its "
                "layer over the prompt; EAGLE-3's fc priced on every pass (vLLM runs it once a step: an upper bound)")


@dataclass(frozen=True)
class PassCost:
    """Seconds of one pass split into its terms (they add up to :attr:`seconds`)."""

    linear_s: float
    attention_s: float
    lm_head_s: float
    comm_s: float
    overhead_s: float

    @property
    def seconds(self) -> float:
        return self.linear_s + self.attention_s + self.lm_head_s + self.comm_s + self.overhead_s


def matmul_seconds(flops: Any, tokens: Any, gpu: GPU, eff: Efficiency) -> Any:
    """Compute seconds of a pass's matrix multiplications over ``tokens`` tokens (the M dimension of each GEMM):
    ``flops / (peak x eff(T))`` with ``eff(T) = compute x T / (T + T_half)`` (``Efficiency.compute_half_tokens``).

    Why this form: a GEMM of M = T rows is cut into output tiles (128 x 128 or 64 x 128 on Hopper) spread over the
    GPU's multiprocessors (132 on an H100 SXM); until T is a few hundred tokens there are fewer tiles than
    multiprocessors, and partly filled waves and tiles leave tensor cores idle ("tile quantization" and "wave
    quantization", NVIDIA, *Matrix Multiplication Background User's Guide*, docs.nvidia.com/deeplearning/performance/
    dl-performance-matrix-multiplication). The efficiency then grows about linearly with T and saturates at the large-
    GEMM efficiency ``compute``; T / (T + T_half) is the one-parameter curve with those two limits, and its seconds,
    ``flops (T + T_half) / (peak compute T)``, are the large-GEMM seconds plus a constant per pass: the cost of the
    partly filled waves. It matters in verification, where B (k + 1) tokens (a few hundred at serving batch sizes) move
    a pass from bandwidth-bound to compute-bound; a decode pass at batch 1 stays bandwidth-bound for any T_half well
    below the ridge point (peak FLOP/s over bytes/s, 295 tokens on an H100). ``T_half`` 0 leaves ``compute`` as is
    (the same seconds, bit for bit). Arrays of ``flops`` and ``tokens`` give arrays."""
    if not eff.compute_half_tokens:
        return flops / (gpu.peak_flops * eff.compute)
    return flops * (tokens + eff.compute_half_tokens) / (gpu.peak_flops * eff.compute * tokens)


def _roofline(compute_s: Any, bytes_moved: Any, gpu: GPU, eff: Efficiency) -> Any:
    """max(compute seconds, bytes / (bandwidth x efficiency)): elementwise for arrays (a pass priced at many
    contexts or query lengths at once), Python's max for numbers. With ``eff.roofline_exponent`` p > 0 the smooth
    roofline (c^p + m^p)^(1/p) instead: a kernel near the ridge point (compute and memory seconds alike) reaches
    neither peak while it overlaps the two, 2^(1/p) x max(c, m) where they are equal, max far from it (the
    hard max assumes both peaks at once; a p of 2-4 is the usual shape of measured GEMM throughput against
    arithmetic intensity)."""
    memory_s = bytes_moved / (gpu.hbm_bandwidth * eff.bandwidth)
    if eff.roofline_exponent:
        p = eff.roofline_exponent
        return (compute_s ** p + memory_s ** p) ** (1.0 / p)
    if isinstance(compute_s, np.ndarray) or isinstance(memory_s, np.ndarray):
        return np.maximum(compute_s, memory_s)
    return max(compute_s, memory_s)


@lru_cache(maxsize=256)
def _precision_factors(quantization: tuple[tuple[str, str], ...], weights: str, gpu: GPU,
                       dtype_bytes: int) -> tuple[dict[str, float], dict[str, float], bool]:
    """Per weight kind: bytes per weight, and the factor that turns its FLOPs into bf16 FLOPs (the roofline's one
    peak: a low-precision rate's FLOPs count as bf16 FLOPs scaled by the rates' ratio); and whether the experts'
    tokens are dispatched in FP8 (they compute in a low-precision format)."""
    precisions = kind_precisions(quantization, weights)
    width = {kind: WEIGHT_BYTES[p] for kind, p in precisions.items()} | {"router": dtype_bytes}
    scale = {kind: gpu.peak_flops / gpu.peak(compute_format(p, gpu.formats)) for kind, p in precisions.items()}
    return width, scale, compute_format(precisions["experts"], gpu.formats) != "bf16"


def pass_cost(arch: Architecture, gpu: GPU, phase: str, batch_size: int, query_len: int, context_len: int,
              dtype_bytes: int = 2, tp: int = 1, eff: Efficiency = Efficiency(),
              verification: str = "multi-query", weights: str = "auto", all_logits: bool = True, ep: int = 1,
              routing_gini: float = 0.0) -> PassCost:
    """The roofline seconds of one ``prefill`` or ``decode`` pass (see the module docstring); ``weights``: the
    projections' precision (:data:`WEIGHT_CHOICES`; ``auto``: the checkpoint's); ``all_logits``: a decode pass
    computes the logits of every new token (a verification), else of each sequence's last (a draft pass, whose
    catch-up feeds several tokens per sequence); ``ep``: expert parallelism over the ``tp`` devices (1 or ``tp``);
    ``routing_gini``: the experts' load skew (:mod:`profiles.architectures.moe`)."""
    if verification not in VERIFICATIONS:
        raise UserError(f"verification must be one of {', '.join(VERIFICATIONS)} (got {verification!r})")
    tokens = batch_size * query_len
    width, scale, fp8_dispatch = _precision_factors(arch.quantization, weights, gpu, dtype_bytes)
    link = gpu.link_bandwidth * eff.link
    all_reduce = eff.collective_latency_s + 2 * (tp - 1) / tp * tokens * arch.hidden * dtype_bytes / link
    linear = attention = comm = 0.0
    for layer, count in arch.layer_counts:
        matmuls = layer.attention.matmuls(tokens, tp) + layer.ffn.matmuls(tokens, tp, ep, routing_gini)
        activations = (15 + 9 * (arch.attention_inputs - 1)) * arch.hidden \
            + layer.attention.activation_elements() / tp + layer.ffn.activation_elements(tp)
        linear += count * _roofline(matmul_seconds(sum(m.flops * scale[m.kind] for m in matmuls), tokens, gpu, eff),
                                    sum(m.weights * width[m.kind] for m in matmuls)
                                    + tokens * activations * dtype_bytes, gpu, eff)
        context = attended_context(context_len, layer.window)
        mean_keys = context + (query_len + 1) / 2
        if phase == "decode" and verification == "batch-expansion":  # q sequences over contexts c + j, each read
            kv_tokens = query_len * context + query_len * (query_len - 1) / 2 + 2 * query_len
        else:
            kv_tokens = context + 2 * query_len
        op = layer.attention.attention(phase, tokens, batch_size, mean_keys, kv_tokens, tp, dtype_bytes)
        attention += count * _roofline(op.flops / (gpu.peak_flops * eff.compute), op.bytes, gpu, eff)
        if tp > 1:  # the attention's output all-reduced; the block's too, or its tokens sent to experts and back
            sent = layer.ffn.all_to_all_bytes(tokens, ep, fp8_dispatch)
            comm += count * (all_reduce + (all_reduce if sent is None else 2 * eff.collective_latency_s + sent / link))
    fc = 0.0
    if arch.fc_inputs:  # a head's fc layer, once a pass: its weights and each token's input and output
        fc = _roofline(matmul_seconds(2 * tokens * arch.fc_params / tp, tokens, gpu, eff),
                       arch.fc_params / tp * width["mlp"]
                       + tokens * (arch.fc_inputs + 1) * arch.hidden * dtype_bytes, gpu, eff)
    logit_rows = tokens if phase == "decode" and all_logits else batch_size
    vocab = arch.lm_vocab  # a shared LM head is read all the same: sharing saves memory, not bandwidth
    head_bytes = (vocab * arch.hidden / tp + logit_rows * vocab / tp + 2 * tokens * arch.hidden) * dtype_bytes
    lm_head = _roofline(matmul_seconds(2 * logit_rows * arch.hidden * vocab / tp, logit_rows, gpu, eff), head_bytes,
                        gpu, eff)
    if tp > 1:
        comm += eff.collective_latency_s + (tp - 1) / tp * logit_rows * vocab * dtype_bytes / link
    return PassCost(linear_s=linear + fc, attention_s=attention, lm_head_s=lm_head,
                    comm_s=comm, overhead_s=eff.overhead_fixed_s + eff.overhead_per_layer_s * arch.num_layers)


# -- shipped profiles ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """A target/draft pair on ``tp`` GPUs of one kind: the target sharded ``tp`` ways (its experts spread over them
    with ``ep`` = ``tp``), a draft head in the target's tensor-parallel group (vLLM's speculative config gives EAGLE
    and MTP drafts the target's size), a draft model whole on the first GPU."""

    gpu_key: str
    target: str
    draft: str
    tp: int
    verification: str = "multi-query"
    weights: str = "auto"
    """The target's projection weights (:data:`WEIGHT_CHOICES`; ``auto``: as its checkpoint stores them)."""
    draft_weights: str = "auto"
    """The draft's projection weights."""
    ep: int = 1
    """Expert parallelism: 1, or ``tp`` (vLLM's ``--enable-expert-parallel``, SGLang's ``--ep-size``)."""
    routing_gini: float = 0.0
    """The experts' load skew (:mod:`profiles.architectures.moe`; 0: uniform routing)."""
    draft_tp: int | None = None
    """Tensor-parallel degree of the drafter: 1, a draft model whole on the first GPU (vLLM v0's
    ``speculative_draft_tensor_parallel_size = 1``); or the target's ``tp``, sharded as the target (vLLM V1's EAGLE
    and draft-model proposers, SGLang's draft worker, run in the target's workers). None: a draft head in the target's
    group, a draft model whole (vLLM v0)."""

    def __post_init__(self) -> None:
        if self.gpu_key not in GPUS:
            raise UserError(f"--gpu: must be one of {', '.join(GPUS)} (got {self.gpu_key!r})")
        if isinstance(self.tp, bool) or not isinstance(self.tp, int) or self.tp < 1:
            raise UserError(f"--tp: must be an integer >= 1 (got {self.tp!r})")
        if self.draft_tp not in (None, 1, self.tp):
            raise UserError(f"--draft-tp: must be 1 or the target's --tp {self.tp} (got {self.draft_tp!r})")
        if self.verification not in VERIFICATIONS:
            raise UserError(f"--verification: must be one of {', '.join(VERIFICATIONS)} (got {self.verification!r})")
        check_weights(self.weights, "--weights")
        check_weights(self.draft_weights, "--draft-weights")
        check_ep(self.ep, self.tp)
        if isinstance(self.routing_gini, bool) or not isinstance(self.routing_gini, (int, float)) \
                or not 0 <= self.routing_gini < 1:
            raise UserError(f"--routing-gini: must be a number in [0, 1) (got {self.routing_gini!r})")

    @property
    def stem(self) -> str:
        """File stem: ``<gpu>[x<tp>]-analytical[-batch-expansion][-<weights>][-draft-<weights>][-ep<ep>]
        [-gini<g>]__<target>__<draft>`` (measured profiles have no ``-analytical``; the defaults, multi-query, bf16
        weights, no expert parallelism and uniform routing, no suffix). The weights named are those priced: a
        checkpoint's own precision too (``-fp8`` for DeepSeek-V3 as published, ``-mxfp4`` for gpt-oss's experts)."""
        gpus = f"{self.gpu_key}x{self.tp}" if self.tp > 1 else self.gpu_key
        suffix = "" if self.verification == "multi-query" else f"-{self.verification}"
        target = Architecture.from_config(self.target, "--target")
        roles = (("", target, self.weights),) + ((("draft-", Architecture.from_config(self.draft, "--draft", target),
                                                  self.draft_weights),) if self.draft else ())
        for prefix, arch, weights in roles:
            stored = [p for p in dict.fromkeys(arch.precisions(weights)[k] for k in arch.projection_kinds)
                      if p != "bf16"]
            suffix += "".join(f"-{prefix}{p}" for p in stored)
        suffix += f"-ep{self.ep}" if self.ep > 1 else ""
        suffix += f"-gini{self.routing_gini:g}" if self.routing_gini else ""
        suffix += f"-draft-tp{self.draft_tp}" if self.draft_tp not in (None, 1) else ""
        return f"{gpus}-analytical{suffix}__{self.target}__{self.draft or 'no-draft'}"


#: The shipped analytical profiles: a 7B pair on one GPU, a 70B pair on the fewest GPUs it fits
#: (140 GB of bf16 weights: 4 x 80 GB, or 2 x 141 GB), verified multi-query; the 7B pair verified by
#: batch expansion (SmartSpec's engine); and Llama-3.1-8B on an H100 with its EAGLE-3 and EAGLE heads (the
#: vLLM-calibrated versions of those are transfers: docs/trees_and_heads.md, "Draft heads"). Then the families of
#: issue 31: Gemma-2-9B with Gemma-2-2B as draft (sliding windows) on an H100 and an A100; Qwen3-8B and Qwen3-30B-A3B
#: (a mixture of experts) with their EAGLE-3 heads on an H200; DeepSeek-V3 as published (FP8, MLA, MoE) on 8 x H200
#: with its MTP layer as draft head; gpt-oss-120b (MXFP4 experts) with gpt-oss-20b on a B200, and on an MI300X
#: Llama-3.1-70B whole (192 GB) and Qwen3-30B-A3B with its EAGLE-3 head.
DEPLOYMENTS = tuple(
    Deployment(gpu, target, draft, tp, verification)
    for gpu, tp70 in (("a100-80gb", 4), ("h100-80gb", 4), ("h200", 2))
    for target, draft, tp, verification in (("llama-2-7b", "llama-68m", 1, "multi-query"),
                                            ("llama-2-7b", "llama-68m", 1, "batch-expansion"),
                                            ("llama-3.1-70b", "llama-3.2-1b", tp70, "multi-query"))
) + tuple(Deployment("h100-80gb", "llama-3.1-8b", head, 1) for head in ("eagle3-llama-3.1-8b", "eagle-llama-3.1-8b")) \
    + tuple(Deployment(gpu, "gemma-2-9b", "gemma-2-2b", 1) for gpu in ("h100-80gb", "a100-80gb")) \
    + (Deployment("h200", "qwen3-8b", "eagle3-qwen3-8b", 1),
       Deployment("h200", "qwen3-30b-a3b", "eagle3-qwen3-30b-a3b", 1),
       Deployment("h200", "deepseek-v3", "mtp", 8),
       Deployment("b200", "gpt-oss-120b", "gpt-oss-20b", 1),
       Deployment("mi300x", "llama-3.1-70b", "llama-3.2-1b", 1),
       Deployment("mi300x", "qwen3-30b-a3b", "eagle3-qwen3-30b-a3b", 1))

#: Share of device memory usable (vLLM's gpu_memory_utilization default) and the activation reserve
#: (GiB) when deciding whether a point's KV cache fits.
MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_GIB = 2.0
#: A deployment's roles: the target, and the drafter where it has one.
ROLES = ("target", "draft")


@dataclass(frozen=True)
class Placement:
    """Where a deployment's target and draft run: each role's architecture, tensor- and expert-parallel degree and
    weights (:meth:`of`), and what the first device holds of them at ``dtype_bytes`` a KV element: the weights'
    bytes, and each role's KV bytes per token by layer window."""

    archs: dict[str, Architecture]
    tps: dict[str, int]
    eps: dict[str, int]
    weights: dict[str, str]
    dtype_bytes: int = 2

    @classmethod
    def of(cls, dep: Deployment, dtype_bytes: int = 2) -> "Placement":
        target = Architecture.from_config(dep.target, "--target")
        if not dep.draft:  # no drafter: an n-gram proposer's deployment (or none)
            return cls({"target": target}, {"target": dep.tp}, {"target": dep.ep}, {"target": dep.weights},
                       dtype_bytes)
        draft = Architecture.from_config(dep.draft, "--draft", target)
        head = draft.head is not None
        draft_tp = dep.draft_tp if dep.draft_tp is not None else dep.tp if head else 1
        placement = cls({"target": target, "draft": draft}, {"target": dep.tp, "draft": draft_tp},
                        {"target": dep.ep, "draft": dep.ep if head else 1},
                        {"target": dep.weights, "draft": dep.draft_weights}, dtype_bytes)
        for role, arch in placement.archs.items():
            arch.check_parallel(placement.tps[role], placement.eps[role], f"--tp ({role} {arch.name})")
        return placement

    @cached_property
    def device_weight_bytes(self) -> float:
        return sum(arch.weight_bytes(self.dtype_bytes, self.weights[role], self.tps[role])
                   for role, arch in self.archs.items())

    @cached_property
    def kv_groups(self) -> list[tuple[int | None, int]]:
        """(window, KV bytes per token on the first device) of both roles' layers."""
        return [group for role, arch in self.archs.items()
                for group in arch.kv_groups(self.dtype_bytes, self.tps[role]).items()]


def kv_fits(place: Placement, gpu: GPU, batch_size: int, seq_tokens: int, new_tokens: int = 1) -> bool:
    """Whether ``batch_size`` sequences of ``seq_tokens`` (``new_tokens`` of them in this pass) of target and draft
    KV cache fit the first device next to the weights (each role's weights and KV per device; a sliding-window
    layer's KV only its window, :func:`~profiles.architectures.sliding.held_tokens`)."""
    kv = batch_size * sum(held_tokens(seq_tokens, new_tokens, window) * size for window, size in place.kv_groups)
    return place.device_weight_bytes + kv + ACTIVATION_RESERVE_GIB * GIB <= MEMORY_UTILIZATION * gpu.memory_gib * GIB


def memory_figures(place: Placement, gpu: GPU, tp: int, dtype_bytes: int) -> dict[str, Any]:
    """The profile's ``memory`` block (:class:`simulator.costs.profile_table.Memory`): one engine over ``tp``
    devices, device memory summed over them and each role's weights and KV per token as the sum of what every
    device holds (a draft model on the first device counted ``tp`` times, so that the simulator's budget (memory -
    weights) / KV per token gives the first device's token capacity); a sliding-window model's KV per token split
    into the part in its sliding layers and their window."""
    archs, tps = place.archs, place.tps
    memory: dict[str, Any] = {"device_memory_gb": gpu.memory_gib * tp}
    for role in ROLES:  # a role without a model (no drafter) holds nothing
        memory[f"{role}_weight_gb"] = archs[role].weight_bytes(dtype_bytes, place.weights[role], tps[role]) * tp / GIB \
            if role in archs else 0.0
    for role in ROLES:
        memory[f"{role}_kv_bytes_per_token"] = archs[role].kv_bytes_per_token(dtype_bytes, tps[role]) * tp \
            if role in archs else 0
    for role, arch in archs.items():
        windows = arch.windows
        if len(windows) > 1:
            raise UserError(f"--{role} {arch.name}: sliding windows of {len(windows)} sizes {windows} (the memory "
                            "figures hold one window a role)")
        if windows:
            groups = arch.kv_groups(dtype_bytes, tps[role])
            memory[f"{role}_sliding_kv_bytes_per_token"] = groups[windows[0]] * tp
            memory[f"{role}_sliding_window"] = windows[0]
    return memory


def analytical_profile(dep: Deployment, grid: Grid, dtype: str = "bf16", eff: Efficiency = Efficiency(),
                       draft_eff: Efficiency | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Rows and metadata of one analytical profile over ``grid``, leaving out points whose KV cache does not fit
    (:func:`kv_fits`). ``draft_eff``: the draft's passes priced with these efficiencies and per-pass overhead (a
    drafter that runs otherwise than the target: vLLM V1's head inside the engine step; default ``eff``). ``dep.draft``
    empty: no drafter (an n-gram proposer's deployment), no draft rows."""
    gpu, dtype_bytes = GPUS[dep.gpu_key], DTYPE_BYTES[dtype]
    place = Placement.of(dep, dtype_bytes)
    archs = place.archs
    effs = {"target": eff, "draft": eff if draft_eff is None else draft_eff}
    rows, skipped = [], 0
    for point in grid.points(tuple(archs)):
        if not kv_fits(place, gpu, point.batch_size, point.context_len + point.query_len, point.query_len):
            skipped += 1
            continue
        role = point.role
        cost = pass_cost(archs[role], gpu, point.phase, point.batch_size, point.query_len, point.context_len,
                         dtype_bytes, place.tps[role], effs[role], dep.verification, place.weights[role],
                         all_logits=role == "target", ep=place.eps[role], routing_gini=dep.routing_gini)
        rows.append({**point.as_dict(), "seconds": cost.seconds, "num_layers": archs[role].num_layers})
    frame = pd.DataFrame(rows).sort_values(["role", "phase", "batch_size", "query_len", "context_len"])

    def model(role: str) -> dict[str, Any]:
        arch = archs[role]
        out = {"config": getattr(dep, role), "model_type": arch.model_type, "num_layers": arch.num_layers,
               "params": arch.params, "active_params": arch.active_params, "tensor_parallel": place.tps[role],
               "expert_parallel": place.eps[role], "weights": arch.weights_label(place.weights[role])}
        if arch.windows:
            out["sliding_windows"] = list(arch.windows)
        return out

    meta = {
        "method": "analytical",
        "verification": dep.verification,
        "device": f"{dep.tp} x {gpu.name}" if dep.tp > 1 else gpu.name,
        "dtype": dtype,
        "target": model("target"),
        "draft": {**model("draft"), **archs["draft"].draft_meta(),
                  **({"pricing": HEAD_PRICING} if archs["draft"].head else {})} if "draft" in archs else
        {"config": None, "note": "no drafter: a deployment for n-gram speculation (or none)"},
        "weights_note": "projection weights at their precision (profiles/architectures/precision.py: bytes with block "
                        "scales; fp8 W8A8 where the GPU has FP8, nvfp4 W4A4 where it has FP4, mxfp4 at the FP8 rate "
                        "on Blackwell, else weight-only at bf16); embeddings, norms, router and LM head bf16; KV in "
                        "dtype",
        "gpu": asdict(gpu),
        "efficiency": eff.record(),
        "efficiency_source": EFFICIENCY_SOURCE,
        "formula": "sum over linear/attention/lm_head of max(FLOPs/(peak*compute), bytes/(bw*bandwidth)) "
                   "+ tensor-parallel all-reduces (or expert-parallel all-to-all) + overhead_fixed_s "
                   "+ overhead_per_layer_s*layers (profiles/analytical.py)",
        "grid": grid.as_dict(),
        "points_left_out": skipped,
        "kv_fit": {"memory_utilization": MEMORY_UTILIZATION, "activation_reserve_gb": ACTIVATION_RESERVE_GIB},
        "memory": memory_figures(place, gpu, dep.tp, dtype_bytes),
        **({"draft_efficiency": draft_eff.record()} if draft_eff is not None else {}),
        "memory_note": "one engine over tp devices: device memory summed over them; each role's weights and KV per "
                       "token summed over the devices that hold them (a draft model, on the first device only, "
                       "counted tp times), so that the simulator's budget (memory - weights) / KV per token gives the "
                       "first device's token capacity; sliding-window layers' share of the KV per token is held for "
                       "their window only",
    }
    if any(arch.active_params < arch.params for arch in archs.values()):
        meta["routing"] = {"routing_gini": dep.routing_gini, "source": ROUTING_GINI_SOURCE}
    return frame, meta


def write_all(out_dir: str | Path, grid: Grid | None = None) -> list[Path]:
    """Write every :data:`DEPLOYMENTS` profile (CSV + ``.meta.json``) over ``grid`` (default: the GPU runs'
    grid) into ``out_dir``; the written CSVs."""
    from simulator.costs.profile_table import write_profile

    paths = []
    for dep in DEPLOYMENTS:
        frame, meta = analytical_profile(dep, grid or GPU_GRID)
        path = Path(out_dir) / f"{dep.stem}.csv"
        write_profile(frame, meta, path)
        paths.append(path)
    return paths


def fit_efficiency(measured: list[tuple[str, str, pd.DataFrame]], gpu_key: str = "h200",
                   start: Efficiency = Efficiency()) -> Efficiency:
    """The compute and bandwidth efficiencies and the two overhead terms that best fit ``measured`` profiles
    (``(target, draft, frame)`` of passes timed on ``gpu_key``): least squares of log(analytical / measured),
    each target/draft x role x phase group weighted alike (scipy's Nelder-Mead)."""
    import numpy as np
    from scipy.optimize import minimize

    gpu, rows = GPUS[gpu_key], []
    for target, draft, frame in measured:
        target_arch = Architecture.from_config(target)
        archs = {"target": target_arch, "draft": Architecture.from_config(draft, "draft", target_arch)}
        for r in frame.itertuples():
            rows.append((archs[r.role], r.phase, int(r.batch_size), int(r.query_len), int(r.context_len),
                         float(r.seconds), f"{target}:{r.role}:{r.phase}"))
    seconds = np.array([r[5] for r in rows])
    groups = pd.Series([r[6] for r in rows])
    weight = (1.0 / groups.map(groups.value_counts())).to_numpy()

    def efficiency(x: Any) -> Efficiency:
        return replace(start, compute=x[0], bandwidth=x[1], overhead_fixed_s=x[2] * 1e-6,
                       overhead_per_layer_s=x[3] * 1e-6)

    def loss(x: Any) -> float:
        if not (0.05 < x[0] <= 1 and 0.05 < x[1] <= 1 and x[2] >= 0 and x[3] >= 0):
            return 1e9
        eff = efficiency(x)
        predicted = np.array([pass_cost(a, gpu, ph, b, q, c, 2, 1, eff, all_logits=":target:" in group).seconds
                              for a, ph, b, q, c, _, group in rows])
        return float(np.sum(weight * np.log(predicted / seconds) ** 2))

    x0 = [start.compute, start.bandwidth, start.overhead_fixed_s * 1e6, start.overhead_per_layer_s * 1e6]
    return efficiency(minimize(loss, x0, method="Nelder-Mead", options={"maxiter": 600}).x)


# -- the command line ----------------------------------------------------------------------------------------------
#: The draft model a shipped target is paired with when ``--draft`` is not given, here and in ``run_sim.py
#: calibrate``: the smallest shipped whole model of the target's tokenizer (Llama 2's, Llama 3's). A target not listed
#: (Qwen2.5-7B, whose 152,064-token vocabulary no shipped small model has; a config file) needs ``--draft``; a draft
#: head (``eagle3-llama-3.1-8b``, ...) is given as one.
DEFAULT_DRAFTS = {"llama-2-7b": "llama-68m", "llama-3.1-8b": "llama-3.2-1b", "llama-3.1-70b": "llama-3.2-1b"}


def draft_for(target: str, draft: str | None) -> str:
    """``draft``, or ``target``'s default (:data:`DEFAULT_DRAFTS`), checked to propose in the target's vocabulary: a
    draft model samples token ids the target verifies, so their vocabularies must be one (vLLM v0 asserts equal
    vocabulary sizes, ``SpecDecodeWorker._vocab_size`` in vllm/spec_decode/spec_decode_worker.py). A draft head's
    vocabulary is checked where it is priced (:meth:`Architecture.head_on`). One :class:`UserError` line otherwise
    (the target's first: a model type the roofline does not read is refused before any draft is looked for)."""
    theirs = Architecture.from_config(target, "--target").vocab
    if draft is None:
        if target not in DEFAULT_DRAFTS:
            raise UserError(f"--draft: --target {target} has no default draft (the shipped targets' are "
                            f"{', '.join(f'{t}: {d}' for t, d in DEFAULT_DRAFTS.items())}); give --draft, a model of "
                            "its tokenizer or a draft head")
        draft = DEFAULT_DRAFTS[target]
    _, draft_config = read_model_config(draft, "--draft", head_ok=True)
    mine = draft_config.get("vocab_size")
    if "speculative_method" not in draft_config and mine != theirs:
        hint = f" (the default for {target}: {DEFAULT_DRAFTS[target]})" if target in DEFAULT_DRAFTS else ""
        raise UserError(f"--draft {draft}: its vocabulary of {mine} tokens is not the target {target}'s {theirs}: a draft "
                        "model proposes the target's token ids, so it must share its tokenizer, and vLLM refuses "
                        f"unequal vocabulary sizes; give --draft a model of the target's tokenizer{hint}")
    return draft


def main(argv: list[str]) -> int:
    parser = FlagParser(prog="python -m profiles.analytical", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DATA_DIR),
                        help="folder for the shipped profiles (default profiles/data), or with --gpu the CSV to write")
    parser.add_argument("--gpu", help=f"make one profile for this GPU ({', '.join(GPUS)}) instead of the shipped set")
    parser.add_argument("--target", default="llama-2-7b", help="target model config (shipped name or path)")
    parser.add_argument("--draft", help="draft model config (shipped name or path) of the target's tokenizer, or a "
                                        "draft head's (eagle3-llama-3.1-8b, eagle-llama-3.1-8b, mtp) (default: the "
                                        "target's, DEFAULT_DRAFTS: llama-68m for llama-2-7b, llama-3.2-1b for Llama 3)")
    parser.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel degree of the target (vLLM's --tensor-parallel-size; default 1)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel degree: 1, or --tp to spread the experts "
                                                          "over the tp GPUs (SGLang's --ep-size; default 1)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="vLLM's flag: expert parallelism over the tp GPUs (--ep equal to --tp)")
    parser.add_argument("--verification", default="multi-query", help=f"{' or '.join(VERIFICATIONS)}")
    parser.add_argument("--weights", default="auto", help=f"target projection weights: {', '.join(WEIGHT_CHOICES)} "
                                                          "(default auto: as the checkpoint stores them)")
    parser.add_argument("--draft-weights", default="auto", help="draft projection weights (default auto)")
    parser.add_argument("--routing-gini", type=float, default=0.0,
                        help="experts' load skew as a Gini coefficient (default 0, uniform routing; measured on real "
                             "text 0.1-0.25+, docs/profiles.md)")
    args = parser.parse_args(argv)
    if args.gpu is None:
        for path in write_all(args.out):
            print(path)
        return 0
    from simulator.costs.profile_table import write_profile

    if args.enable_expert_parallel and args.ep not in (1, args.tp):
        raise UserError(f"--enable-expert-parallel: spreads the experts over the --tp {args.tp} GPUs; --ep {args.ep} "
                        "says otherwise")
    ep = args.tp if args.enable_expert_parallel else args.ep
    dep = Deployment(args.gpu, args.target, draft_for(args.target, args.draft), args.tp, args.verification,
                     args.weights, args.draft_weights, ep, args.routing_gini)
    frame, meta = analytical_profile(dep, GPU_GRID)
    out = Path(args.out)
    if out.is_dir():
        out = out / f"{dep.stem}.csv"
    write_profile(frame, meta, out)
    print(out)
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
