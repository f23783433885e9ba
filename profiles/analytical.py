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

Weight precision (``weights`` for the target, ``draft_weights`` for the draft: :data:`WEIGHT_BYTES`, bf16, fp8,
int8 or int4, *weight-only*): the projections' weights are stored and read at that width (dequantized in the
kernel, compute stays bf16, as in AWQ/GPTQ/Marlin kernels), which shrinks weight memory (more KV room) and
the weight-read time of memory-bound passes; embeddings, norms and the LM head stay bf16; KV stays ``dtype``.

with the operator classes

- ``linear`` (per layer): the q/k/v/o and gate/up/down projections. FLOPs = 2 x tokens x params;
  bytes = the layer's weights, read once per pass, plus the activations each unfused HF-style kernel
  reads and writes (:meth:`Architecture.activation_elements`).
- ``attention`` (per layer): FLOPs = 4 x heads x head_dim x query_len x (context_len + (query_len + 1) / 2)
  per sequence (QK^T and PV, causal over the new tokens); bytes depend on how the engine verifies
  (:data:`VERIFICATIONS`, recorded as ``verification`` in the metadata):

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
published head, a quarter of the target's 128,256). A head's prefill is its layer over the prompt (vLLM's EAGLE
proposer runs the head over the prompt's tokens and the target's hidden states after the target's prefill); there
is no separate model to prefill. Its memory is its own weights (fc, layer, norms, EAGLE-3's LM head; the embedding,
and EAGLE's and MTP's LM head, are the target's) and one layer's KV per token. Approximation: EAGLE-3's fc runs once
a step in vLLM (over the target's fused states of the tokens just verified), but a profile row is one draft pass,
so every pass is priced with it: an upper bound by the fc's share of a pass (a tenth of an 8B head's weight reads)
on passes 2..k. The per-pass overhead is the engine's, as for a draft model's pass: ``overhead_fixed_s +
overhead_per_layer_s`` (one layer) here, and a calibrated profile's ``pass_overhead_s`` in full
(:func:`profiles.calibrate.transfer`; vLLM v0 ran EAGLE through the draft model runner).

A model too large for one GPU (Llama-3.1-70B in bf16 does not fit 80 GB) runs with tensor parallelism
of degree ``tp`` (Megatron-LM, Shoeybi et al. 2019, sec. 3): FLOPs, weights and KV heads split ``tp``
ways and each layer adds two all-reduces of the layer's activations (tokens x hidden x dtype bytes),
ring all-reduce time ``latency + 2 (tp - 1) / tp x bytes / (link_bw x eff_link)`` (Patarasuk and Yuan
2009), plus an all-gather of the vocabulary-parallel logits. The draft model runs unsharded on the
first device (vLLM's ``speculative_draft_tensor_parallel_size = 1``), which makes that device the one
whose memory runs out first; or, with ``Deployment.draft_tp`` = ``tp``, sharded as the target (vLLM V1 and SGLang
run the drafter in the target's workers), paying its own all-reduces.

The roofline models an engine that appends to the KV cache in place (vLLM's paged cache; this project's optimized
forward); the HF ``DynamicCache`` of the eager measured profiles copies the whole cache on each pass, so those
exceed these at large batch x context. ``python -m profiles.analytical --out profiles/data`` regenerates the
shipped profiles; ``python -m profiles.analytical --gpu h200 --target llama-2-7b --draft llama-68m --weights int4
--out P.csv`` makes one (then ``run_sim.py simulate --profile P.csv``).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from profiles.grid import GPU_GRID, Grid
from profiles.models.config import HEAD_SHAPES, read_model_config
from policies.errors import UserError, exit_on_user_error
from simulator.costs.profile_table import VERIFICATIONS


DATA_DIR = Path(__file__).resolve().parent / "data"
GIB = 1024 ** 3

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
#: Bytes per projection weight at each weight-only precision (int4: two weights a byte; group scales ignored).
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}


# -- architectures -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Architecture:
    """The sizes of a decoder-only transformer that costs and memory depend on (counts, not bytes); or of a draft head
    (:data:`profiles.models.config.HEAD_SHAPES`: an fc layer, decoder layer(s) of its target's width and an LM head,
    on the target's hidden states)."""

    name: str
    num_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    qkv_bias: bool
    head: str | None = None
    """A draft head's method (``eagle``, ``eagle3``, ``mtp``); None: a whole model."""
    fc_inputs: int = 0
    """Input width of the head's fc layer in hidden sizes (output: one); 0: no fc layer."""
    attention_inputs: int = 1
    """Input width of the q/k/v projections in hidden sizes (EAGLE-3's attention reads [embedding, fc output]: 2)."""
    logit_vocab: int | None = None
    """Rows of the LM head when not ``vocab`` (EAGLE-3's reduced draft vocabulary)."""
    shares_embedding: bool = False
    """The embedding is the target's: read, not held (a head)."""
    shares_lm_head: bool = False
    """The LM head is the target's: computed with, not held (EAGLE, MTP)."""

    @classmethod
    def from_config(cls, spec: str, where: str = "model", target: "Architecture | None" = None) -> "Architecture":
        """From a shipped model name or a config file path (``where`` names the flag in errors); a draft head's
        config needs the ``target`` whose hidden states it reads (:meth:`head_on`)."""
        path, data = read_model_config(spec, where, head_ok=True)
        if "speculative_method" not in data:
            return cls.from_dict(data, path.stem, str(path))
        if target is None:
            raise UserError(f"{where}: {path} is an {data['speculative_method']} draft head: it runs on a target's "
                            "hidden states, so it is priced as the draft of a target (give --target too)")
        return cls.head_on(target, data, path.stem, str(path))

    @classmethod
    def head_on(cls, target: "Architecture", data: dict[str, Any], name: str, where: str) -> "Architecture":
        """A draft head's architecture (``data``: its config, :mod:`profiles.models.config`) on ``target``: the sizes
        the config leaves out are the target's, one decoder layer unless it says; its hidden size and vocabulary
        must be the target's (it reads the target's hidden states and shares its embedding)."""
        method = data["speculative_method"]
        shape = HEAD_SHAPES[method]
        inherited = {"model_type": "qwen2" if target.qkv_bias else "llama", "hidden_size": target.hidden,
                     "num_attention_heads": target.heads, "num_key_value_heads": target.kv_heads,
                     "head_dim": target.head_dim, "intermediate_size": target.intermediate,
                     "vocab_size": target.vocab, "num_hidden_layers": 1}
        arch = cls.from_dict({**inherited, **data}, name, where)
        for key, mine, theirs, why in (("hidden_size", arch.hidden, target.hidden, "reads the target's hidden states"),
                                       ("vocab_size", arch.vocab, target.vocab, "shares the target's embedding")):
            if mine != theirs:
                raise UserError(f"{where}: {key} {mine} is not the target {target.name}'s {theirs}: an {method} head "
                                f"{why}")
        if shape.attention_inputs > 1 and arch.num_layers != 1:
            raise UserError(f"{where}: num_hidden_layers must be 1 for an {method} head (its one layer's attention "
                            f"reads [embedding, fc output]; got {arch.num_layers})")
        draft_vocab = data.get("draft_vocab_size")
        if draft_vocab is not None and not shape.own_lm_head:
            raise UserError(f"{where}: draft_vocab_size: an {method} head computes its logits with the target's LM "
                            "head (only an eagle3 head has a vocabulary of its own)")
        if draft_vocab is not None and (isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int)
                                        or not 0 < draft_vocab <= arch.vocab):
            raise UserError(f"{where}: draft_vocab_size must be an integer in [1, vocab_size {arch.vocab}] "
                            f"(got {draft_vocab!r})")
        return replace(arch, head=method, fc_inputs=shape.fc_inputs, attention_inputs=shape.attention_inputs,
                       logit_vocab=draft_vocab if shape.own_lm_head else None, tied_embeddings=False,
                       shares_embedding=True, shares_lm_head=not shape.own_lm_head)

    @classmethod
    def from_dict(cls, data: dict[str, Any], name: str, where: str) -> "Architecture":
        """From a parsed ``config.json`` of a supported ``model_type`` (HF defaults where a key is absent)."""

        def size(key: str, default: int | None = None) -> int:
            value = default if data.get(key) is None else data[key]
            if value is None:
                raise UserError(f"{where}: {key} missing")
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise UserError(f"{where}: {key} must be a positive integer (got {value!r})")
            return value

        hidden, heads = size("hidden_size"), size("num_attention_heads")
        head_dim = data.get("head_dim") or hidden // heads
        return cls(name=name, num_layers=size("num_hidden_layers"), hidden=hidden, heads=heads,
                   kv_heads=size("num_key_value_heads", heads), head_dim=size("head_dim", head_dim),
                   intermediate=size("intermediate_size"), vocab=size("vocab_size"),
                   tied_embeddings=bool(data.get("tie_word_embeddings", False)),
                   qkv_bias=data["model_type"] == "qwen2" or bool(data.get("attention_bias", False)))

    def with_layers(self, num_layers: int) -> "Architecture":
        """The same model cut (or grown) to ``num_layers`` decoder layers."""
        return replace(self, num_layers=num_layers)

    @property
    def lm_vocab(self) -> int:
        """Rows of the LM head (the logits a pass computes per token): ``vocab``, or a head's draft vocabulary."""
        return self.vocab if self.logit_vocab is None else self.logit_vocab

    @property
    def layer_linear_params(self) -> int:
        """Weights of one layer's projections: q, k, v (over ``attention_inputs`` hidden sizes), o (attention) and
        gate, up, down (SwiGLU MLP)."""
        q_out, kv_out = self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = q_out + 2 * kv_out if self.qkv_bias else 0
        return self.attention_inputs * self.hidden * (q_out + 2 * kv_out) + q_out * self.hidden \
            + 3 * self.hidden * self.intermediate + bias

    @property
    def fc_params(self) -> int:
        """Weights of a head's fc layer: ``fc_inputs`` hidden sizes in, one out (no bias, as vLLM's); 0 for a model."""
        return self.fc_inputs * self.hidden * self.hidden

    @property
    def params(self) -> int:
        """Parameters held in memory: layers (projections and two RMSNorms each, EAGLE-3's third), final norm,
        embedding and LM head; a head holds its fc layer, layer(s), norms and its own LM head only (EAGLE-3's), the
        embedding (and EAGLE's and MTP's LM head) being the target's."""
        embedding = 0 if self.shares_embedding else self.vocab * self.hidden
        lm_head = 0 if self.shares_lm_head or self.tied_embeddings else self.lm_vocab * self.hidden
        norms = (self.num_layers * 2 + self.attention_inputs) * self.hidden  # two a layer, the final one, EAGLE-3's
        return self.num_layers * self.layer_linear_params + self.fc_params + norms + embedding + lm_head

    def weight_bytes(self, dtype_bytes: float, linear_bytes: float | None = None) -> float:
        """Bytes of the weights: the projections (a head's fc layer too) at ``linear_bytes`` per parameter
        (weight-only quantization; default ``dtype_bytes``), embeddings, norms and LM head at ``dtype_bytes``."""
        linear = self.num_layers * self.layer_linear_params + self.fc_params
        other = self.params - linear
        return linear * (dtype_bytes if linear_bytes is None else linear_bytes) + other * dtype_bytes

    def draft_meta(self) -> dict[str, Any]:
        """What a profile's metadata says of this model as a draft: for a head its method (vLLM's name, which a
        simulation's ``speculative_method`` must match), what it shares with the target and its LM head's rows."""
        if self.head is None:
            return {}
        shared = ["embedding"] + (["lm_head"] if self.shares_lm_head else [])
        return {"speculative_method": self.head, "shares_with_target": shared, "fc_inputs": self.fc_inputs,
                "attention_inputs": self.attention_inputs, "lm_head_rows": self.lm_vocab,
                "structure": HEAD_SHAPES[self.head].source}

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """KV cache bytes of one token: 2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * dtype_bytes

    def activation_elements(self, tp: int = 1) -> float:
        """Elements one token's activations move through one layer's unfused kernels (reads + writes):
        the two RMSNorms and residual adds and the projections' inputs and outputs (15 x hidden; EAGLE-3's
        attention over [embedding, x] adds its third RMSNorm, the concatenation and q/k/v's wider input, 9 x hidden),
        the attention-width tensors q, k, v, rotary and attention output ((5 heads + 4 kv_heads) x head_dim)
        and the MLP's gate/up outputs, SiLU-and-multiply and down input (6 x intermediate); the
        attention- and MLP-width ones split over ``tp`` devices."""
        sharded = 6 * self.intermediate + (5 * self.heads + 4 * self.kv_heads) * self.head_dim
        return (15 + 9 * (self.attention_inputs - 1)) * self.hidden + sharded / tp


# -- hardware ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GPU:
    """Datasheet figures: dense bf16 tensor FLOP/s, HBM bytes/s, memory GiB, NVLink bytes/s per direction."""

    name: str
    peak_flops: float
    hbm_bandwidth: float
    memory_gib: float
    link_bandwidth: float
    source: str


GPUS: dict[str, GPU] = {
    "a100-80gb": GPU("NVIDIA A100-SXM4-80GB", 312e12, 2.039e12, 80.0, 300e9,
                     "NVIDIA A100 Tensor Core GPU datasheet (2021): bf16 312 TFLOPS dense, HBM2e 2,039 GB/s, "
                     "80 GB (81920 MiB); NVLink3 600 GB/s total = 300 GB/s per direction"),
    "h100-80gb": GPU("NVIDIA H100 80GB HBM3 (SXM5)", 989e12, 3.35e12, 81559 / 1024, 450e9,
                     "NVIDIA H100 Tensor Core GPU datasheet (2023), SXM5: bf16 989 TFLOPS dense (1,979 with "
                     "sparsity), HBM3 3.35 TB/s, 80 GB (81559 MiB usable); NVLink4 900 GB/s = 450 per direction"),
    "h200": GPU("NVIDIA H200 (SXM)", 989e12, 4.8e12, 143771 / 1024, 450e9,
                "NVIDIA H200 Tensor Core GPU datasheet (2024), SXM: bf16 989 TFLOPS dense (1,979 with "
                "sparsity), HBM3e 4.8 TB/s, 141 GB (143771 MiB usable); NVLink4 900 GB/s = 450 per direction"),
}


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

    def record(self) -> dict[str, float]:
        """The fields as a profile's metadata records them; ``compute_half_tokens`` only where it is set (0, a constant
        efficiency, is what a profile without it means: the metadata of every profile made before it stays as it
        was)."""
        return {k: v for k, v in asdict(self).items() if k != "compute_half_tokens" or v}


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
    contexts or query lengths at once), Python's max for numbers."""
    memory_s = bytes_moved / (gpu.hbm_bandwidth * eff.bandwidth)
    if isinstance(compute_s, np.ndarray) or isinstance(memory_s, np.ndarray):
        return np.maximum(compute_s, memory_s)
    return max(compute_s, memory_s)


def pass_cost(arch: Architecture, gpu: GPU, phase: str, batch_size: int, query_len: int, context_len: int,
              dtype_bytes: int = 2, tp: int = 1, eff: Efficiency = Efficiency(),
              verification: str = "multi-query", weight_bytes: float | None = None,
              all_logits: bool = True) -> PassCost:
    """The roofline seconds of one ``prefill`` or ``decode`` pass (see the module docstring); ``weight_bytes``:
    bytes per projection weight (weight-only quantization; default ``dtype_bytes``); ``all_logits``: a decode pass
    computes the logits of every new token (a verification), else of each sequence's last (a draft pass, whose
    catch-up feeds several tokens per sequence)."""
    weight_bytes = dtype_bytes if weight_bytes is None else weight_bytes
    if verification not in VERIFICATIONS:
        raise UserError(f"verification must be one of {', '.join(VERIFICATIONS)} (got {verification!r})")
    tokens = batch_size * query_len
    kv_width = 2 * arch.kv_heads * arch.head_dim / tp  # K and V elements per token and layer on one device
    linear = _roofline(matmul_seconds(2 * tokens * arch.layer_linear_params / tp, tokens, gpu, eff),
                       arch.layer_linear_params / tp * weight_bytes
                       + tokens * arch.activation_elements(tp) * dtype_bytes,
                       gpu, eff)
    mean_keys = context_len + (query_len + 1) / 2
    if phase == "decode" and verification == "batch-expansion":  # q sequences over contexts c + j, each read
        kv_tokens = query_len * context_len + query_len * (query_len - 1) / 2 + 2 * query_len
    else:
        kv_tokens = context_len + 2 * query_len
    attention = _roofline(4 * tokens * mean_keys * arch.heads * arch.head_dim / tp / (gpu.peak_flops * eff.compute),
                          batch_size * kv_tokens * kv_width * dtype_bytes, gpu, eff)
    fc = 0.0
    if arch.fc_inputs:  # a head's fc layer, once a pass: its weights and each token's input and output
        fc = _roofline(matmul_seconds(2 * tokens * arch.fc_params / tp, tokens, gpu, eff),
                       arch.fc_params / tp * weight_bytes
                       + tokens * (arch.fc_inputs + 1) * arch.hidden * dtype_bytes, gpu, eff)
    logit_rows = tokens if phase == "decode" and all_logits else batch_size
    vocab = arch.lm_vocab  # a shared LM head is read all the same: sharing saves memory, not bandwidth
    head_bytes = (vocab * arch.hidden / tp + logit_rows * vocab / tp + 2 * tokens * arch.hidden) * dtype_bytes
    lm_head = _roofline(matmul_seconds(2 * logit_rows * arch.hidden * vocab / tp, logit_rows, gpu, eff), head_bytes,
                        gpu, eff)
    comm = 0.0
    if tp > 1:
        link = gpu.link_bandwidth * eff.link
        all_reduce = eff.collective_latency_s + 2 * (tp - 1) / tp * tokens * arch.hidden * dtype_bytes / link
        gather = eff.collective_latency_s + (tp - 1) / tp * logit_rows * vocab * dtype_bytes / link
        comm = 2 * arch.num_layers * all_reduce + gather
    return PassCost(linear_s=arch.num_layers * linear + fc, attention_s=arch.num_layers * attention, lm_head_s=lm_head,
                    comm_s=comm, overhead_s=eff.overhead_fixed_s + eff.overhead_per_layer_s * arch.num_layers)


# -- shipped profiles ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Deployment:
    """A target/draft pair on ``tp`` GPUs of one kind (the target sharded ``tp`` ways, the draft whole on
    the first GPU)."""

    gpu_key: str
    target: str
    draft: str
    tp: int
    verification: str = "multi-query"
    weights: str = "bf16"
    """The target's projection weights (:data:`WEIGHT_BYTES`; weight-only)."""
    draft_weights: str = "bf16"
    """The draft's projection weights."""
    draft_tp: int = 1
    """Tensor-parallel degree of the draft: 1, whole on the first GPU (vLLM v0's ``speculative_draft_tensor_parallel_size
    = 1``); or the target's ``tp`` where the drafter runs in the target's workers, sharded as the target is (vLLM V1's
    EAGLE and draft-model proposers, SGLang's draft worker)."""

    def __post_init__(self) -> None:
        if self.gpu_key not in GPUS:
            raise UserError(f"--gpu: must be one of {', '.join(GPUS)} (got {self.gpu_key!r})")
        if not isinstance(self.tp, int) or self.tp < 1:
            raise UserError(f"--tp: must be an integer >= 1 (got {self.tp!r})")
        if self.draft_tp not in (1, self.tp):
            raise UserError(f"--draft-tp: must be 1 or the target's --tp {self.tp} (got {self.draft_tp!r})")
        if self.verification not in VERIFICATIONS:
            raise UserError(f"--verification: must be one of {', '.join(VERIFICATIONS)} (got {self.verification!r})")
        for flag, value in (("--weights", self.weights), ("--draft-weights", self.draft_weights)):
            if value not in WEIGHT_BYTES:
                raise UserError(f"{flag}: must be one of {', '.join(WEIGHT_BYTES)} (got {value!r})")

    @property
    def stem(self) -> str:
        """File stem: ``<gpu>[x<tp>]-analytical[-batch-expansion][-<weights>][-draft-<weights>]__<target>__<draft>``
        (measured profiles have no ``-analytical``; the defaults, multi-query and bf16, no suffix)."""
        gpus = f"{self.gpu_key}x{self.tp}" if self.tp > 1 else self.gpu_key
        suffix = "" if self.verification == "multi-query" else f"-{self.verification}"
        suffix += "" if self.weights == "bf16" else f"-{self.weights}"
        suffix += "" if self.draft_weights == "bf16" else f"-draft-{self.draft_weights}"
        suffix += "" if self.draft_tp == 1 else f"-draft-tp{self.draft_tp}"
        return f"{gpus}-analytical{suffix}__{self.target}__{self.draft}"


#: The shipped analytical profiles: a 7B pair on one GPU, a 70B pair on the fewest GPUs it fits
#: (140 GB of bf16 weights: 4 x 80 GB, or 2 x 141 GB), verified multi-query; the 7B pair verified by
#: batch expansion (SmartSpec's engine); and Llama-3.1-8B on an H100 with its EAGLE-3 and EAGLE heads (the
#: vLLM-calibrated versions of those are transfers: README, "Draft heads").
DEPLOYMENTS = tuple(
    Deployment(gpu, target, draft, tp, verification)
    for gpu, tp70 in (("a100-80gb", 4), ("h100-80gb", 4), ("h200", 2))
    for target, draft, tp, verification in (("llama-2-7b", "llama-68m", 1, "multi-query"),
                                            ("llama-2-7b", "llama-68m", 1, "batch-expansion"),
                                            ("llama-3.1-70b", "llama-3.2-1b", tp70, "multi-query"))
) + tuple(Deployment("h100-80gb", "llama-3.1-8b", head, 1) for head in ("eagle3-llama-3.1-8b", "eagle-llama-3.1-8b"))

#: Share of device memory usable (vLLM's gpu_memory_utilization default) and the activation reserve
#: (GiB) when deciding whether a point's KV cache fits.
MEMORY_UTILIZATION = 0.9
ACTIVATION_RESERVE_GIB = 2.0


def kv_fits(target: Architecture, draft: Architecture | None, gpu: GPU, tp: int, tokens: int, dtype_bytes: int = 2,
            target_weight_bytes: float | None = None, draft_weight_bytes: float | None = None,
            draft_tp: int = 1) -> bool:
    """Whether ``tokens`` tokens of target and draft KV cache fit the first device next to the weights
    (target weights and KV split ``tp`` ways, the draft's ``draft_tp`` ways (1: whole there); projection weights at the
    given bytes; ``draft`` None: no drafter, an n-gram proposer's deployment)."""
    weights = target.weight_bytes(dtype_bytes, target_weight_bytes) / tp
    kv = tokens * target.kv_bytes_per_token(dtype_bytes) / tp
    if draft is not None:
        weights += draft.weight_bytes(dtype_bytes, draft_weight_bytes) / draft_tp
        kv = tokens * (target.kv_bytes_per_token(dtype_bytes) / tp + draft.kv_bytes_per_token(dtype_bytes) / draft_tp)
    return weights + kv + ACTIVATION_RESERVE_GIB * GIB <= MEMORY_UTILIZATION * gpu.memory_gib * GIB


def analytical_profile(dep: Deployment, grid: Grid, dtype: str = "bf16", eff: Efficiency = Efficiency(),
                       draft_eff: Efficiency | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Rows and metadata of one analytical profile over ``grid``, leaving out points whose KV cache does not fit
    (:func:`kv_fits`). ``draft_eff``: the draft's passes priced with these efficiencies and per-pass overhead (a
    drafter that runs otherwise than the target: vLLM V1's head inside the engine step; default ``eff``). ``dep.draft``
    empty: no drafter (an n-gram proposer's deployment), no draft rows."""
    gpu, dtype_bytes = GPUS[dep.gpu_key], DTYPE_BYTES[dtype]
    target = Architecture.from_config(dep.target, "--target")
    archs = {"target": target, "draft": Architecture.from_config(dep.draft, "--draft", target) if dep.draft else None}
    tps = {"target": dep.tp, "draft": dep.draft_tp}
    effs = {"target": eff, "draft": eff if draft_eff is None else draft_eff}
    wbytes = {"target": WEIGHT_BYTES[dep.weights], "draft": WEIGHT_BYTES[dep.draft_weights]}
    rows, skipped = [], 0
    for point in grid.points(("target", "draft") if dep.draft else ("target",)):
        tokens = point.batch_size * (point.context_len + point.query_len)
        if not kv_fits(archs["target"], archs["draft"], gpu, dep.tp, tokens, dtype_bytes, wbytes["target"],
                       wbytes["draft"], dep.draft_tp):
            skipped += 1
            continue
        arch = archs[point.role]
        cost = pass_cost(arch, gpu, point.phase, point.batch_size, point.query_len, point.context_len,
                         dtype_bytes, tps[point.role], effs[point.role], dep.verification, wbytes[point.role],
                         all_logits=point.role == "target")
        rows.append({**point.as_dict(), "seconds": cost.seconds, "num_layers": arch.num_layers})
    frame = pd.DataFrame(rows).sort_values(["role", "phase", "batch_size", "query_len", "context_len"])
    draft = archs["draft"]
    memory = {
        "device_memory_gb": gpu.memory_gib * dep.tp,
        "target_weight_gb": archs["target"].weight_bytes(dtype_bytes, wbytes["target"]) / GIB,
        "draft_weight_gb": draft.weight_bytes(dtype_bytes, wbytes["draft"]) * dep.tp / dep.draft_tp / GIB
        if draft is not None else 0.0,
        "target_kv_bytes_per_token": archs["target"].kv_bytes_per_token(dtype_bytes),
        "draft_kv_bytes_per_token": draft.kv_bytes_per_token(dtype_bytes) * dep.tp // dep.draft_tp
        if draft is not None else 0,
    }
    meta = {
        "method": "analytical",
        "verification": dep.verification,
        "device": f"{dep.tp} x {gpu.name}" if dep.tp > 1 else gpu.name,
        "dtype": dtype,
        "target": {"config": dep.target, "num_layers": archs["target"].num_layers, "params": archs["target"].params,
                   "tensor_parallel": dep.tp, "weights": dep.weights},
        "draft": {"config": dep.draft, "num_layers": draft.num_layers, "params": draft.params,
                  "tensor_parallel": dep.draft_tp, "weights": dep.draft_weights, **draft.draft_meta(),
                  **({"pricing": HEAD_PRICING} if draft.head else {})} if draft is not None else
        {"config": None, "note": "no drafter: a deployment for n-gram speculation (or none)"},
        "weights_note": "weight-only precision of the projections (embeddings, norms and LM head bf16); compute "
                        "bf16; KV in dtype",
        "gpu": asdict(gpu),
        "efficiency": eff.record(),
        "efficiency_source": EFFICIENCY_SOURCE,
        "formula": "sum over linear/attention/lm_head of max(FLOPs/(peak*compute), bytes/(bw*bandwidth)) "
                   "+ tensor-parallel all-reduces + overhead_fixed_s + overhead_per_layer_s*layers "
                   "(profiles/analytical.py)",
        "grid": grid.as_dict(),
        "points_left_out": skipped,
        "kv_fit": {"memory_utilization": MEMORY_UTILIZATION, "activation_reserve_gb": ACTIVATION_RESERVE_GIB},
        "memory": memory,
        **({"draft_efficiency": draft_eff.record()} if draft_eff is not None else {}),
        "memory_note": "one engine over tp devices: device memory summed over them; the draft (weights and "
                       "KV, on the first device only) counted tp times, so that the simulator's budget "
                       "(memory - weights) / KV per token gives the first device's token capacity"
                       if dep.draft_tp == 1 else
                       "one engine over tp devices: device memory, the target's and the draft's weights and KV (the "
                       "draft sharded as the target) summed over them",
    }
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m profiles.analytical", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(DATA_DIR),
                        help="folder for the shipped profiles (default profiles/data), or with --gpu the CSV to write")
    parser.add_argument("--gpu", help=f"make one profile for this GPU ({', '.join(GPUS)}) instead of the shipped set")
    parser.add_argument("--target", default="llama-2-7b", help="target model config (shipped name or path)")
    parser.add_argument("--draft", default="llama-68m", help="draft model config (shipped name or path), or a draft "
                                                             "head's (eagle3-llama-3.1-8b, eagle-llama-3.1-8b, mtp)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree of the target (default 1)")
    parser.add_argument("--verification", default="multi-query", help=f"{' or '.join(VERIFICATIONS)}")
    parser.add_argument("--weights", default="bf16", help=f"target projection weights: {', '.join(WEIGHT_BYTES)} "
                                                          "(weight-only; default bf16)")
    parser.add_argument("--draft-weights", default="bf16", help="draft projection weights (default bf16)")
    args = parser.parse_args(argv)
    if args.gpu is None:
        for path in write_all(args.out):
            print(path)
        return 0
    from simulator.costs.profile_table import write_profile

    dep = Deployment(args.gpu, args.target, args.draft, args.tp, args.verification, args.weights, args.draft_weights)
    frame, meta = analytical_profile(dep, GPU_GRID)
    out = Path(args.out)
    if out.is_dir():
        out = out / f"{dep.stem}.csv"
    write_profile(frame, meta, out)
    print(out)
    return 0


if __name__ == "__main__":
    exit_on_user_error(main, sys.argv[1:])
