"""Chunks back to back in one buffer, as a restore reply lies in shared memory: read as one
array by ``kvstore.format.chunk_run.decode_chunks``, with no join. numpy only (the client's
import of it must not load torch)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvstore.format.errors import InvalidRequest

Buffer = bytes | bytearray | memoryview


class PackedRun(Sequence[memoryview]):
    """Chunks back to back in one buffer: chunk i is ``buffer[offsets[i]:offsets[i] +
    lengths[i]]``. A sequence of those views to every other reader; ``decode_chunks``
    reads the run from the buffer without joining it first."""

    def __init__(self, buffer: Buffer, lengths: Sequence[int]) -> None:
        self.buffer = np.frombuffer(buffer, np.uint8)  # (bytes,) uint8
        self.lengths = np.asarray(lengths, np.int64).reshape(-1)
        self.offsets = np.zeros(len(self.lengths), np.int64)
        np.cumsum(self.lengths[:-1], out=self.offsets[1:])
        if len(self.lengths) and (self.lengths.min() < 0
                                  or self.offsets[-1] + self.lengths[-1] > len(self.buffer)):
            raise InvalidRequest(f"{self.lengths.sum()} B of chunks do not fit a "
                                 f"{len(self.buffer)} B buffer")

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        at = int(self.offsets[index])
        return memoryview(self.buffer[at:at + int(self.lengths[index])])

    def __iter__(self) -> Iterator[memoryview]:
        return map(self.__getitem__, range(len(self)))

    def followed_by(self, tail: Buffer) -> PackedRun | None:
        """This run with ``tail`` as one more chunk when ``tail`` lies right after it in
        the same buffer (as a restore reply's tail follows its chunks); else None."""
        view = np.frombuffer(tail, np.uint8)
        end = int(self.offsets[-1] + self.lengths[-1]) if len(self) else 0
        here = self.buffer.__array_interface__["data"][0] + end
        if (not view.size or end + view.size > len(self.buffer)
                or view.__array_interface__["data"][0] != here):
            return None
        return PackedRun(self.buffer, [*self.lengths.tolist(), view.size])
