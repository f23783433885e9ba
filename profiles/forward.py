"""The forward passes that the profiler times and the real serving engine runs: one code path for both.

A model is built from an HF ``config.json`` (random weights by default, ``AutoModelForCausalLM.from_config``,
SDPA attention, eval mode) straight on its device. A pass is one of

- :func:`prefill_pass`: ``batch_size`` prompts of ``P`` tokens into a fresh KV cache, logits of the last
  token only (what a serving engine samples from);
- :func:`decode_pass`: ``q`` new tokens per sequence over a cache of ``L`` tokens each, logits of all ``q``
  (a target verification pass has ``q = k + 1``, a draft or plain decode pass ``q = 1``), followed by
  :func:`crop` to drop them again.

:func:`random_cache` builds the ``L``-token cache directly as a ``transformers.DynamicCache`` of random
(normal, not zero) keys and values, so a long context costs a tensor fill instead of a long prefill;
attention reads the same bytes either way. Sequences are unpadded: positions run ``L .. L + q - 1`` and
the attention mask is all ones.

Works with transformers 5.x: the cache keyword is ``cache`` from 5.2x on and ``past_key_values`` before
(:func:`_cache_kwarg` asks the model's signature); ``DynamicCache.crop`` takes a negative count (tokens to
drop) in every 5.x. Model configs are validated by :func:`profiles.analytical.read_model_config`.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from profiles.analytical import read_model_config
from simulator.errors import UserError

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

transformers.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()


# -- device --------------------------------------------------------------------------------------
def setup_device(device: str, threads: int | None) -> torch.device:
    """Check ``device`` (``cpu`` or ``cuda``); on CPU fix the thread count and flush denormals (random
    weights must not hit the slow denormal path)."""
    if device == "cuda":
        if not torch.cuda.is_available():
            raise UserError("--device: cuda asked for, but torch sees no CUDA device")
        return torch.device("cuda", torch.cuda.current_device())
    if device != "cpu":
        raise UserError(f"--device: must be cpu or cuda (got {device!r})")
    if threads is not None:
        torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU, where every op is synchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_name(device: torch.device) -> str:
    """``torch.cuda.get_device_name`` or the CPU model from ``/proc/cpuinfo``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"


def total_memory_bytes(device: torch.device) -> int:
    """Device memory (CUDA) or system memory (CPU), bytes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return _meminfo_bytes("MemTotal")


def free_memory_bytes(device: torch.device) -> int:
    """Bytes a new allocation can still get: free device memory plus what torch's caching allocator holds
    unused (CUDA), or ``MemAvailable`` (CPU)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return _meminfo_bytes("MemAvailable")


def release_memory(device: torch.device) -> None:
    """Return cached blocks to the device (after an out-of-memory error)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is an allocation failure (CUDA OOM, or the CPU allocator giving up)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))


def _meminfo_bytes(field: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/meminfo has no {field}")


# -- models --------------------------------------------------------------------------------------
def load_config(spec: str, where: str, num_layers: int | None = None) -> PretrainedConfig:
    """The HF config of a shipped model name or a ``config.json`` path, optionally cut to ``num_layers``."""
    _, data = read_model_config(spec, where)
    fields = {k: v for k, v in data.items() if k != "model_type"}
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    config = AutoConfig.for_model(data["model_type"], **fields)
    layer_types = getattr(config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise UserError(f"{where}: sliding-window attention layers are not supported (got {sorted(set(layer_types))})")
    return config


def build_model(config: PretrainedConfig, dtype: str, device: torch.device, seed: int = 0,
                weights_dir: str | os.PathLike | None = None) -> PreTrainedModel:
    """A model of ``config`` on ``device`` in ``dtype``, in eval mode: random weights (seeded), or the
    weights saved in ``weights_dir`` (``from_pretrained``; the layer count of ``config`` is kept)."""
    torch.manual_seed(seed)
    if weights_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(weights_dir, config=config, dtype=DTYPES[dtype],
                                                     attn_implementation="sdpa").to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model.eval().requires_grad_(False)


def _cache_kwarg(model: PreTrainedModel) -> str:
    """The forward keyword of the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# -- passes --------------------------------------------------------------------------------------
@torch.inference_mode()
def random_cache(model: PreTrainedModel, batch_size: int, context_len: int,
                 generator: torch.Generator) -> DynamicCache:
    """A ``DynamicCache`` holding ``context_len`` tokens of standard-normal keys and values per sequence."""
    config = model.config
    cache = DynamicCache(config=config)
    shape = (batch_size, config.num_key_value_heads, context_len, _head_dim(config))
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator, dtype=model.dtype, device=model.device)
                        for _ in range(2))
        cache.update(keys, values, layer)
    return cache


def random_tokens(model: PreTrainedModel, batch_size: int, length: int, generator: torch.Generator) -> torch.Tensor:
    """Token ids, uniform over the vocabulary, shape ``(batch_size, length)``."""
    return torch.randint(model.config.vocab_size, (batch_size, length), generator=generator, device=model.device)


@torch.inference_mode()
def decode_pass(model: PreTrainedModel, cache: DynamicCache, input_ids: torch.Tensor) -> torch.Tensor:
    """Run ``input_ids`` (``batch x q``) over ``cache`` (equal, unpadded lengths), appending their KV;
    the logits of all ``q`` positions."""
    batch_size, query_len = input_ids.shape
    context_len = cache.get_seq_length()
    positions = torch.arange(context_len, context_len + query_len, device=input_ids.device).expand(batch_size, -1)
    mask = torch.ones(batch_size, context_len + query_len, dtype=torch.long, device=input_ids.device)
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                logits_to_keep=query_len, **{_cache_kwarg(model): cache})
    return out.logits


def crop(cache: DynamicCache, num_tokens: int) -> None:
    """Drop the last ``num_tokens`` tokens of every sequence from ``cache``."""
    cache.crop(-num_tokens)


@torch.inference_mode()
def prefill_pass(model: PreTrainedModel, input_ids: torch.Tensor) -> tuple[torch.Tensor, DynamicCache]:
    """Run whole prompts ``input_ids`` (``batch x P``) into a new cache; the last position's logits and
    the cache."""
    batch_size, prompt_len = input_ids.shape
    cache = DynamicCache(config=model.config)
    positions = torch.arange(prompt_len, device=input_ids.device).expand(batch_size, -1)
    mask = torch.ones(batch_size, prompt_len, dtype=torch.long, device=input_ids.device)
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                logits_to_keep=1, **{_cache_kwarg(model): cache})
    return out.logits, cache
