"""The forward passes that the profiler times and the real serving engine runs: one code path for both.

A model is built from an HF ``config.json`` of one of the families :mod:`profiles.models.families` lists (random
weights by default, ``AutoModelForCausalLM.from_config``, the family's attention implementation, eval mode) straight
on its device. A pass is one of

- :func:`prefill_pass`: ``batch_size`` prompts of ``P`` tokens into a fresh KV cache, logits of the last
  token only (what a serving engine samples from);
- :func:`decode_pass`: ``q`` new tokens per sequence over a cache of ``L`` tokens each, logits of all ``q``
  (a target verification pass has ``q = k + 1``, a draft or plain decode pass ``q = 1``), followed by
  :func:`crop` to drop them again.

:func:`random_cache` builds the ``L``-token cache directly as a ``transformers.DynamicCache`` of random
(normal, not zero) keys and values, so a long context costs a tensor fill instead of a long prefill;
attention reads the same bytes either way. Sequences are unpadded: positions run ``L .. L + q - 1`` and
the attention mask is all ones. These passes use transformers' own cache for the config (:func:`new_cache`: Gemma-2's
sliding layers keep only their window).

The serving engine's batches of unequal sequences (:class:`BatchCache`) also run token trees: :func:`tree_pass`
feeds a block whose slots attend where a 4-D mask says (tree attention) and returns hidden states, and
:func:`keep_tokens` masks out every fed token but an accepted path. Their cache keeps every token in every layer
(padded rows are compacted and rolled back by slot, which a layer dropping tokens would break); a sliding-window
layer's window is then applied by the mask (:func:`_attention_mask`), counted in each sequence's own tokens.

Works with transformers 5.x: the cache keyword is ``cache`` from 5.2x on and ``past_key_values`` before
(:func:`_cache_kwarg` asks the model's signature); ``DynamicCache.crop`` takes a negative count (tokens to
drop) in every 5.x. Model configs are read by :func:`profiles.models.families.read_family_config`.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache, PretrainedConfig, PreTrainedModel

from profiles.models.families import family, read_family_config
from policies.errors import UserError

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
    path, data = read_family_config(spec, where)
    return hf_config(data, str(path), num_layers)


def hf_config(data: dict, where: str, num_layers: int | None = None) -> PretrainedConfig:
    """The HF config of a parsed ``config.json`` of a family :mod:`profiles.models.families` lists (checked by
    :func:`profiles.models.families.read_family_config`), optionally cut to ``num_layers``. A sliding window on
    every layer (Mistral-style, no ``layer_types``) is refused: the engine's masks apply windows by layer type."""
    fields = {k: v for k, v in data.items() if k != "model_type"}
    if num_layers is not None:
        fields["num_hidden_layers"] = num_layers
    config = AutoConfig.for_model(data["model_type"], **fields)
    if getattr(config, "sliding_window", None) is not None and sliding_window(config) is None:
        raise UserError(f"{where}: sliding_window {config.sliding_window} without sliding layer_types (a window on "
                        f"every layer of a {data['model_type']} model) is not supported")
    return config


def build_model(config: PretrainedConfig, dtype: str, device: torch.device, seed: int = 0,
                weights_dir: str | os.PathLike | None = None) -> PreTrainedModel:
    """A model of ``config`` on ``device`` in ``dtype``, in eval mode, with its family's attention implementation:
    random weights (seeded), or the weights saved in ``weights_dir`` (``from_pretrained``; the layer count of
    ``config`` is kept)."""
    torch.manual_seed(seed)
    attention = family(config.model_type).attention
    if weights_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(weights_dir, config=config, dtype=DTYPES[dtype],
                                                     attn_implementation=attention).to(device)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype], attn_implementation=attention)
    return model.eval().requires_grad_(False)


def parameter_count(config: PretrainedConfig) -> int:
    """Parameters of a model of ``config`` as transformers builds it (counted on the meta device: no memory; a tied
    embedding once)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def logits(model: PreTrainedModel, states: torch.Tensor) -> torch.Tensor:
    """The logits of final-normed hidden states ``states`` (``(..., hidden)``): the LM head, then the family's final
    soft-capping, ``c tanh(x / c)`` (Gemma-2), as the model's own forward computes them."""
    out = model.lm_head(states)
    cap = getattr(model.config, "final_logit_softcapping", None)
    return out if cap is None else torch.tanh(out / cap) * cap


def new_cache(model: PreTrainedModel, whole: bool = False) -> DynamicCache:
    """An empty cache for ``model``: transformers' own for its config (a sliding-window layer keeps its last
    ``sliding_window - 1`` tokens), its sliding layers recording their past until the next :func:`crop`, so that a
    pass can be cropped off again; or, ``whole``, one that keeps every token in every layer (:class:`BatchCache`)."""
    if whole:
        return DynamicCache([(None, None)] * model.config.num_hidden_layers)
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    return cache


def _cache_kwarg(model: PreTrainedModel) -> str:
    """The forward keyword of the KV cache: ``cache`` (transformers >= 5.2x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


# -- passes --------------------------------------------------------------------------------------
@torch.inference_mode()
def random_cache(model: PreTrainedModel, batch_size: int, context_len: int,
                 generator: torch.Generator, whole: bool = False) -> DynamicCache:
    """A cache (:func:`new_cache`; ``whole``: every layer keeps every token) holding ``context_len`` tokens of
    standard-normal keys and values per sequence."""
    config = model.config
    cache = new_cache(model, whole)
    shape = (batch_size, config.num_key_value_heads, context_len, _head_dim(config))
    for layer in range(config.num_hidden_layers):
        keys, values = (torch.randn(shape, generator=generator, dtype=model.dtype, device=model.device)
                        for _ in range(2))
        cache.update(keys, values, layer)
    cache.crop(0)  # a sliding layer keeps its window
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
    cache = new_cache(model)
    positions = torch.arange(prompt_len, device=input_ids.device).expand(batch_size, -1)
    mask = torch.ones(batch_size, prompt_len, dtype=torch.long, device=input_ids.device)
    out = model(input_ids=input_ids, position_ids=positions, attention_mask=mask, use_cache=True,
                logits_to_keep=1, **{_cache_kwarg(model): cache})
    return out.logits, cache


# -- batches of unequal sequences: the serving engine's path ---------------------------------------
class BatchCache:
    """The KV cache of a batch of sequences of unequal lengths (the serving engine's running batch).

    ``cache`` is one ``DynamicCache`` holding ``width`` slots per sequence; ``valid[i, j]`` says whether
    slot ``j`` of sequence ``i`` holds one of its tokens. Invalid slots (left padding, and tokens that were
    rolled back under sequences that kept more) are masked out of attention, so a sequence attends to
    exactly its own tokens; a token's position id is the number of valid slots before it. New tokens are
    appended on the right of every sequence at once (:func:`batch_pass`).
    """

    def __init__(self, cache: DynamicCache, valid: torch.Tensor) -> None:
        self.cache = cache
        self.valid = valid
        """bool, ``(batch_size, width)``."""

    @property
    def batch_size(self) -> int:
        return int(self.valid.shape[0])

    @property
    def width(self) -> int:
        return int(self.valid.shape[1])

    def lengths(self) -> torch.Tensor:
        """Tokens held per sequence (int64, ``(batch_size,)``)."""
        return self.valid.sum(dim=1)


def empty_batch_cache(model: PreTrainedModel, batch_size: int) -> BatchCache:
    """A cache of ``batch_size`` sequences holding no tokens yet (for a prefill)."""
    return BatchCache(new_cache(model, whole=True), torch.zeros(batch_size, 0, dtype=torch.bool, device=model.device))


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of the model's sliding-window layers (tokens: a query sees the keys of its last ``window``
    positions, itself included), or None when every layer attends to the whole context."""
    return config.sliding_window if "sliding_attention" in (getattr(config, "layer_types", None) or ()) else None


def _attention_mask(model: PreTrainedModel, visible: torch.Tensor, key_positions: torch.Tensor,
                    query_positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The ``attention_mask`` of a pass whose new slots see the slots ``visible`` says (bool ``(B, q, W)``; keys at
    rotary positions ``key_positions`` ``(B, W)``, queries at ``query_positions`` ``(B, q)``): the 4-D mask; where the
    model has sliding-window layers, one per layer type (``sliding_attention`` also hides keys ``window`` or more
    positions before the query's, as transformers' sliding mask does, but counted in the sequence's own tokens, not
    in slots), in the form the model's attention takes (eager attention adds it to the scores: 0 or the dtype's
    lowest value)."""
    masks = {"full_attention": visible}
    window = sliding_window(model.config)
    if window is not None:
        masks["sliding_attention"] = visible & (key_positions[:, None, :] > query_positions[..., None] - window)
    if model.config._attn_implementation == "eager":
        lowest = torch.finfo(model.dtype).min
        masks = {k: torch.zeros(m.shape, dtype=model.dtype, device=m.device).masked_fill_(~m, lowest)
                 for k, m in masks.items()}
    masks = {k: m[:, None] for k, m in masks.items()}
    return masks if window is not None else masks["full_attention"]


@torch.inference_mode()
def batch_pass(model: PreTrainedModel, batch: BatchCache, tokens: list[list[int]], logits_to_keep: int) -> torch.Tensor:
    """Run ``tokens[i]`` (one or more new tokens) after the cached tokens of sequence ``i``, appending their KV.

    The new tokens form a block of ``q = max len(tokens[i])`` slots per sequence, left-padded (the pad
    slots invalid), so every sequence's last new token is in the block's last column. Returns the logits
    of the block's last ``logits_to_keep`` columns, ``(batch_size, logits_to_keep, vocab)``.
    """
    device = model.device
    lens = torch.tensor([len(t) for t in tokens], device=device)
    q = int(lens.max())
    # one host-to-device copy for the whole block, left-padded
    ids = torch.tensor([[0] * (q - len(t)) + list(t) for t in tokens], dtype=torch.long, device=device)
    block = torch.arange(q, device=device)
    new_valid = block >= (q - lens)[:, None]
    positions = (batch.lengths()[:, None] - (q - lens)[:, None] + block).clamp(min=0)
    valid = torch.cat([batch.valid, new_valid], dim=1)
    mask = valid.long()  # transformers makes it causal
    if sliding_window(model.config) is not None or model.config._attn_implementation == "eager":
        # the 4-D mask made here: causal over the valid slots, each new slot (padding too: no empty row) seeing itself
        slots = torch.arange(batch.width + q, device=device)
        itself = slots == batch.width + block[:, None]                                     # (q, W)
        mask = _attention_mask(model, (valid[:, None, :] & (slots < batch.width + block[:, None])) | itself,
                               valid.cumsum(dim=1) - 1, positions)
    out = model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                logits_to_keep=logits_to_keep, **{_cache_kwarg(model): batch.cache})
    batch.valid = valid
    return out.logits


@torch.inference_mode()
def tree_pass(model: PreTrainedModel, batch: BatchCache, ids: torch.Tensor, embeds: torch.Tensor | None,
              positions: torch.Tensor, visible: torch.Tensor, new_valid: torch.Tensor) -> torch.Tensor:
    """Run a block of ``q`` new slots per sequence after ``batch``'s slots, attending where ``visible`` says,
    appending their KV; the final-normed hidden states of the block ``(batch_size, q, hidden)``.

    ``ids`` ``(batch_size, q)`` token ids, or ``embeds`` ``(batch_size, q, hidden)`` input embeddings instead (an
    EAGLE head's fused input); ``positions`` ``(batch_size, q)`` their rotary positions; ``visible``
    ``(batch_size, q, width + q)`` bool, which cached and new slots each new slot attends to (a token tree's
    ancestors: tree attention, passed to the attention as a 4-D mask, :func:`_attention_mask`); ``new_valid``
    ``(batch_size, q)`` which new slots hold tokens (the rest are padding, masked out of later passes). The caller
    computes the logits of the columns it needs (:func:`logits`).
    """
    inputs = {"inputs_embeds": embeds} if embeds is not None else {"input_ids": ids}
    mask = _attention_mask(model, visible, torch.cat([batch.valid.cumsum(dim=1) - 1, positions], dim=1), positions)
    out = model.model(**inputs, position_ids=positions, attention_mask=mask, use_cache=True,
                      **{_cache_kwarg(model.model): batch.cache})
    batch.valid = torch.cat([batch.valid, new_valid], dim=1)
    return out.last_hidden_state


@torch.inference_mode()
def keep_tokens(batch: BatchCache, keep: torch.Tensor) -> None:
    """Keep the tokens of each sequence that ``keep`` marks (bool, ``(batch_size, most tokens held)``: token t of
    sequence i is its t-th valid slot), masking the others out; trailing slots that no sequence keeps are cropped.
    A kept token keeps its rotary position: keep tokens whose positions still count them in order (the prefix
    and one path of a token tree)."""
    held = (batch.valid.cumsum(dim=1) - 1).clamp(min=0)                  # (B, width): token index of each slot
    batch.valid &= keep.gather(1, held.clamp(max=keep.shape[1] - 1))
    _crop_unused(batch)


@torch.inference_mode()
def truncate(batch: BatchCache, lengths: torch.Tensor) -> None:
    """Keep the first ``lengths[i]`` tokens of sequence ``i`` (int64, ``(batch_size,)``), dropping later ones;
    trailing slots that no sequence keeps are cropped from the cache."""
    batch.valid &= batch.valid.cumsum(dim=1) <= lengths[:, None]
    _crop_unused(batch)


def _crop_unused(batch: BatchCache) -> None:
    """Crop the trailing slots that no sequence holds a token in."""
    used = torch.nonzero(batch.valid.any(dim=0))
    width = int(used.max()) + 1 if used.numel() else 0
    if width < batch.width:
        crop(batch.cache, batch.width - width)
        batch.valid = batch.valid[:, :width]


@torch.inference_mode()
def select_rows(model: PreTrainedModel, batch: BatchCache, rows: list[int]) -> BatchCache:
    """A new cache of sequences ``rows`` of ``batch`` (in that order), compacted (see :func:`merge`)."""
    index = torch.as_tensor(rows, dtype=torch.long, device=batch.valid.device)
    return _compacted(model, [(batch, index)])


@torch.inference_mode()
def merge(model: PreTrainedModel, parts: list[BatchCache]) -> BatchCache:
    """One cache holding the sequences of ``parts`` in order, compacted: each sequence's tokens moved to
    the right end of a width of the longest sequence's length, no invalid slot after its first token."""
    return _compacted(model, [(part, None) for part in parts])


def _compacted(model: PreTrainedModel, parts: list[tuple[BatchCache, torch.Tensor | None]]) -> BatchCache:
    """The sequences of ``parts`` (all rows, or ``rows``), each moved to the right end of a common width."""
    width = max(int((part.valid if rows is None else part.valid[rows]).sum(dim=1).max()) for part, rows in parts)
    plans, valids = [], []
    for part, rows in parts:
        valid = part.valid if rows is None else part.valid[rows]
        source = torch.arange(part.batch_size, device=valid.device) if rows is None else rows
        # A stable sort puts each row's invalid slots first and its tokens after them, in order; a part
        # narrower than the width reads its slot 0 for the padding (masked out, so any finite values do).
        order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)
        order = order[:, part.width - width:] if part.width >= width else \
            torch.nn.functional.pad(order, (width - part.width, 0))
        valids.append(torch.arange(width, device=valid.device) >= (width - valid.sum(dim=1))[:, None])
        keys = part.cache.layers[0].keys
        heads, slots = keys.shape[1], keys.shape[2]
        # One row gather per tensor: row (b, h, w) of the result is row (source[b], h, order[b, w]) of the part.
        rows_index = (source[:, None, None] * heads + torch.arange(heads, device=valid.device)[:, None]) * slots
        plans.append((part, (rows_index + order[:, None, :]).reshape(-1), (len(source), heads, width)))
    cache = new_cache(model, whole=True)
    for layer, held in enumerate(cache.layers):
        gathered = []
        for name in ("keys", "values"):
            pieces = [getattr(part.cache.layers[layer], name) for part, _, _ in plans]
            pieces = [t.reshape(-1, t.shape[-1]).index_select(0, index).view(*shape, t.shape[-1])
                      for t, (_, index, shape) in zip(pieces, plans)]
            gathered.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces))
        # Hand the gathered tensors to the layer as they are (``update`` would copy them once more).
        held.lazy_initialization(*gathered)
        held.keys, held.values = gathered
    return BatchCache(cache, torch.cat(valids))
