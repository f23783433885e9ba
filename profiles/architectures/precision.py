"""Weight precision: bytes per stored weight, and the precision the tensor cores compute at.

A model's projection weights are stored at a precision per weight kind (:data:`profiles.architectures.base.
WEIGHT_KINDS`): the checkpoint's (its ``quantization_config``, :func:`read_quantization`: DeepSeek-V3's block FP8 on
every projection, gpt-oss's MXFP4 on the experts only), or ``--weights`` for every kind but the router. Embeddings,
norms, the router and the LM head stay bf16; the KV cache stays in the activation dtype.

Bytes per weight (:data:`WEIGHT_BYTES`, block scales included, ``profiles/data/moe_speculation/
architecture_notes.md`` sec. 4): bf16 2; fp8 and int8 1 (DeepSeek's one FP32 scale per 128 x 128 block adds 0.02%,
left out); int4 0.5 (group scales left out); **mxfp4 0.53125** (OCP Microscaling v1.0: 32 E2M1 values share an 8-bit
E8M0 scale, 4.25 bits); **nvfp4 0.5625** (NVIDIA ModelOpt: 16 E2M1 values share an E4M3 scale, 4.5 bits).

Compute precision (:func:`compute_format`), as vLLM runs each format:

- ``fp8``: W8A8 at the GPU's FP8 rate where it has FP8 tensor cores (Hopper, Ada, Blackwell, CDNA3: vLLM's
  ``Fp8LinearMethod`` quantizes activations per token); else weight-only at bf16 (Ampere: vLLM's FP8 Marlin kernel,
  ``vllm/model_executor/layers/quantization/utils/marlin_utils_fp8.py``: "For GPUs that lack FP8 hardware support,
  we can leverage the Marlin kernel for fast weight-only FP8 quantization").
- ``nvfp4``: W4A4 at the FP4 rate on Blackwell (vLLM's ``ModelOptNvFp4LinearMethod``, ``cutlass_scaled_fp4_mm``;
  ModelOpt's NVFP4 quantizes activations too); elsewhere weight-only at bf16 (``marlin_utils_fp4.py``, FP4 Marlin on
  SM80+).
- ``mxfp4``: on Blackwell, MXFP4 weights with MXFP8 activations at the FP8 rate (vLLM's default MoE backend there,
  ``Mxfp4Backend.SM100_FI_MXFP4_MXFP8_TRTLLM`` in ``vllm/model_executor/layers/quantization/mxfp4.py``); elsewhere
  weight-only at bf16 (Hopper's ``mxfp4_w4a16`` Triton kernels; no FP4 on CDNA3).
- ``int8``, ``int4``: weight-only (AWQ/GPTQ/Marlin kernels dequantize in the kernel), bf16 compute.

FP4 tensor cores are Blackwell's only (B200, GB200 in ``profiles/data/gpus.csv``).
"""
from __future__ import annotations

from typing import Any

from policies.errors import UserError
from profiles.architectures.base import WEIGHT_KINDS, Config

#: Bytes per stored weight at each precision (module docstring).
WEIGHT_BYTES = {"bf16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5, "mxfp4": 0.53125, "nvfp4": 0.5625}
#: ``--weights`` values: a precision for every projection, or ``auto``, the checkpoint's.
WEIGHT_CHOICES = ("auto",) + tuple(WEIGHT_BYTES)
#: The kinds ``--weights`` sets (the router stays bf16, as every checkpoint read here keeps it).
PROJECTIONS = tuple(k for k in WEIGHT_KINDS if k != "router")

#: ``quantization_config.quant_method`` values read here and the precision they store.
QUANT_METHODS = {"fp8": "fp8", "mxfp4": "mxfp4"}
#: Names in ``modules_to_not_convert`` / ``ignored_layers`` and the weight kinds they keep at bf16.
MODULE_KINDS = {"self_attn": ("attention",), "attn": ("attention",), "mlp.router": ("router",),
                "gate": ("router",), "shared_experts": ("shared_experts",), "experts": ("experts",),
                "mlp": ("mlp", "experts", "shared_experts")}


def read_quantization(config: Config) -> tuple[tuple[str, str], ...]:
    """The checkpoint's precision by weight kind from ``quantization_config`` (none: ``()``, all bf16). Methods other
    than :data:`QUANT_METHODS` are refused (one line naming the key): their bytes and kernels are not modelled."""
    quant: Any = config.data.get("quantization_config")
    if quant is None:
        return ()
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in QUANT_METHODS:
        raise UserError(f"{config.where}: quantization_config.quant_method {method!r} is not modelled (known: "
                        f"{', '.join(QUANT_METHODS)}); give --weights for the precision to price")
    kept: set[str] = {"router"}
    for name in (quant.get("modules_to_not_convert") or []) + (quant.get("ignored_layers") or []):
        name = str(name).rstrip("*.")
        matches = [key for key in MODULE_KINDS if name == key or name.endswith("." + key)]
        if matches:
            kept.update(MODULE_KINDS[max(matches, key=len)])
    return tuple((kind, QUANT_METHODS[method]) for kind in PROJECTIONS if kind not in kept)


def check_weights(value: str, flag: str) -> None:
    if value not in WEIGHT_CHOICES:
        raise UserError(f"{flag}: must be one of {', '.join(WEIGHT_CHOICES)} (got {value!r})")


def kind_precisions(checkpoint: tuple[tuple[str, str], ...], weights: str) -> dict[str, str]:
    """Each weight kind's precision: ``weights`` for every projection kind, or with ``auto`` the checkpoint's."""
    if weights == "auto":
        stored = dict(checkpoint)
        return {kind: stored.get(kind, "bf16") for kind in WEIGHT_KINDS}
    return {kind: weights if kind in PROJECTIONS else "bf16" for kind in WEIGHT_KINDS}


def label(precisions: dict[str, str], kinds: tuple[str, ...]) -> str:
    """One word for the precision of a model's projection ``kinds``: ``bf16``, ``fp8``, or the kinds not bf16
    (``experts mxfp4``)."""
    if len({precisions[k] for k in kinds}) == 1:
        return precisions[kinds[0]]
    return ", ".join(f"{k} {precisions[k]}" for k in kinds if precisions[k] != "bf16")


def compute_format(precision: str, formats: frozenset[str]) -> str:
    """The tensor-core format a projection stored at ``precision`` computes in on a GPU with ``formats`` (of
    ``fp8``, ``fp4``): module docstring."""
    if precision == "fp8" and "fp8" in formats:
        return "fp8"
    if precision == "nvfp4" and "fp4" in formats:
        return "fp4"
    if precision == "mxfp4" and "fp4" in formats:
        return "fp8"
    return "bf16"
