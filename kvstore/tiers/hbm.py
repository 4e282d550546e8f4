"""The HBM tier: values held as uint8 tensors on the serving device.

On a CUDA machine a co-located inference or replay worker reads a value in place with
``get_tensor`` (no copy); ``get`` copies it to host memory for everyone else. Without
CUDA the device is the CPU, so the same code paths run and are tested everywhere.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kvstore.tiers.host import MemoryTier


def serving_device() -> torch.device:
    """The current CUDA device when there is one, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class HBMTier(MemoryTier):
    name: ClassVar[str] = "hbm"

    def __init__(self, capacity_bytes: int, *, device: torch.device | str | None = None) -> None:
        device = serving_device() if device is None else torch.device(device)
        super().__init__(capacity_bytes, device=device, pin_memory=False)
