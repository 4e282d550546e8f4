"""Output memory of decoded runs, reused once every tensor of a run is gone.

A decode writes every byte of fresh memory it hands out. Memory the kernel hands a
process comes zeroed, one page fault per 4 KiB page, and glibc returns large blocks to the
kernel when they are freed (mmapped above its threshold, trimmed below it), so each decode
of a session of some MB would pay the faults again: on a VM more than the copy itself.
``take(n)`` gives an (n,) uint8 array; once it and every view of it (tensors made from it
included) are collected, its memory goes back to a small pool (at most ``POOL_BYTES``
idle, the least recently returned let go first) for the next ``take`` of that size. A
decode overwrites every byte it exposes, so nothing of an earlier run is ever visible
through a reused buffer.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict

import numpy as np

POOL_BYTES = 256 << 20  # idle memory kept for reuse, at most
_ROUND = 1 << 16  # sizes are kept in buckets of 64 KiB
_MIN = 1 << 20  # smaller blocks are reused by the allocator anyway

_lock = threading.Lock()
_idle: OrderedDict[int, np.ndarray] = OrderedDict()  # id -> idle block, oldest first
_idle_bytes = 0


def take(nbytes: int) -> np.ndarray:
    """(nbytes,) uint8, contents undefined: every byte must be written before use."""
    if nbytes < _MIN:
        return np.empty(nbytes, np.uint8)
    size = -(-nbytes // _ROUND) * _ROUND
    global _idle_bytes
    owner = None
    with _lock:
        for key in reversed(_idle):  # the most recently returned block of this size
            if _idle[key].size == size:
                owner = _idle.pop(key)
                _idle_bytes -= size
                break
    if owner is None:
        owner = np.empty(size, np.uint8)
    # a view whose base is not an array: views of it keep it (not ``owner``) as their base,
    # so it is collected only when the last of them is
    out = np.frombuffer(owner.data, np.uint8, nbytes)
    weakref.finalize(out, _give_back, owner)
    return out


def _give_back(owner: np.ndarray) -> None:
    global _idle_bytes
    with _lock:
        if owner.size > POOL_BYTES:
            return
        _idle[id(owner)] = owner
        _idle_bytes += owner.size
        while _idle_bytes > POOL_BYTES:
            _idle_bytes -= _idle.popitem(last=False)[1].size
