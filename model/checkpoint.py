"""Saving and loading the model's weights: safetensors, with the config beside them.

Weights are stored as fp16 and loaded as float32. The config travels twice on purpose:
inside the safetensors metadata (so a weights file is self-describing) and as a readable
JSON file next to it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, safe_open, save_file

from model.config import ModelConfig
from model.net import KVTierLM

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"
BUNDLED_WEIGHTS = WEIGHTS_DIR / "bundled.safetensors"
BUNDLED_CONFIG = WEIGHTS_DIR / "bundled.json"


def save(model: KVTierLM, path: Path = BUNDLED_WEIGHTS) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # fp16 halves the file (the 16 MB budget); every weight is well inside fp16's range
    tensors = {k: v.detach().to(torch.float16).contiguous().cpu()
               for k, v in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"config": model.cfg.to_json()})
    path.with_suffix(".json").write_text(model.cfg.to_json() + "\n")


def load_config(path: Path = BUNDLED_WEIGHTS) -> ModelConfig:
    """The config stored with the weights at `path` (their header only is read)."""
    if not path.exists():
        raise FileNotFoundError(f"no weights at {path}: run `python -m model.train`")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise ValueError(f"{path} carries no model config in its metadata")
    return ModelConfig.from_json(meta["config"])


def load(path: Path = BUNDLED_WEIGHTS, device: torch.device | str = "cpu") -> KVTierLM:
    """Model in eval mode with the weights (and config) stored at `path`."""
    model = KVTierLM(load_config(path))
    tensors = {k: v.float() for k, v in load_file(str(path), device="cpu").items()}
    model.load_state_dict(tensors, strict=True)
    return model.to(device).eval()


def load_bundled(device: torch.device | str = "cpu") -> KVTierLM:
    """The shipped model: model/weights/bundled.safetensors."""
    return load(BUNDLED_WEIGHTS, device)
