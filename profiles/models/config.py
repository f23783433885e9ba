"""Architecture configs: a shipped name (``profiles/models/<name>.json``) or a path to an HF ``config.json``."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from policies.errors import UserError

MODELS_DIR = Path(__file__).resolve().parent

#: Architectures whose structure (RMSNorm, rotary attention with grouped KV heads, SwiGLU MLP, full
#: attention in every layer) the roofline, the memory estimate and the KV-cache builder know.
SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


def resolve_model_config(spec: str, where: str) -> Path:
    """The config file ``spec`` names: an existing path, or ``profiles/models/<spec>.json``."""
    path = Path(spec)
    if path.is_file():
        return path
    shipped = MODELS_DIR / f"{spec}.json"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in MODELS_DIR.glob("*.json")))
    raise UserError(f"{where}: no model config file or shipped model named {spec!r} (shipped: {known})")


def read_model_config(spec: str, where: str) -> tuple[Path, dict[str, Any]]:
    """Resolve and parse an HF ``config.json``-style file; anything else is a one-line UserError."""
    path = resolve_model_config(spec, where)
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UserError(f"{path}: not a JSON model config ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise UserError(f"{path}: not a model config: model_type missing")
    if data["model_type"] not in SUPPORTED_MODEL_TYPES:
        raise UserError(f"{path}: model_type is an unknown architecture (got {data['model_type']!r}); "
                        f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    return path, data
