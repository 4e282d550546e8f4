"""Training and evaluation bytes: the running interpreter's own standard library sources.

Files are read in sorted path order and joined with a blank-line separator, so the corpus
(and everything trained on it) is a function of the interpreter version only. A fixed list
of top-level packages is held out for evaluation; test suites are left out of both.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path

import torch

HELD_OUT = ("asyncio", "email", "json")  # top-level stdlib packages kept for evaluation
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
SEPARATOR = b"\n\n"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def source_files(held_out: bool) -> list[Path]:
    """Sorted .py files of the training split (held_out=False) or the evaluation split."""
    root = stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if SKIP_DIRS.intersection(parts[:-1]):
            continue
        top = parts[0].removesuffix(".py")
        if (top in HELD_OUT) == held_out:
            files.append(path)
    if not files:
        raise FileNotFoundError(f"no stdlib sources found under {root}")
    return files


@functools.cache  # 11 MB read from a few thousand files; each stage and test asks again
def corpus(held_out: bool) -> bytes:
    return SEPARATOR.join(path.read_bytes() for path in source_files(held_out))


class BatchSampler:
    """Deterministic random windows of a byte corpus: batch i depends only on (seed, i)."""

    def __init__(self, data: bytes, seq_len: int, batch: int, seed: int):
        self.data = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        if self.data.numel() <= seq_len:
            raise ValueError(f"corpus of {self.data.numel()} bytes is shorter than {seq_len}")
        self.seq_len, self.batch = seq_len, batch
        self.gen = torch.Generator().manual_seed(seed)

    def state(self) -> torch.Tensor:
        """The generator's state: restore() continues the same sequence of batches."""
        return self.gen.get_state()

    def restore(self, state: torch.Tensor) -> None:
        self.gen.set_state(state)

    def next(self) -> torch.Tensor:
        """(batch, seq_len + 1) int64: inputs are [:, :-1], targets [:, 1:]."""
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch,),
                               generator=self.gen)
        offsets = torch.arange(self.seq_len + 1)
        return self.data[starts.unsqueeze(1) + offsets].long()
