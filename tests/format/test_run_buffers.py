"""run_buffers: a decoded run's memory is reused only once nothing can see it any more."""

from __future__ import annotations

import gc

import numpy as np
import torch

from kvstore.format import run_buffers
from kvstore.format.chunk_run import decode_chunks
from tests.format.test_chunk_run import session
from tests.support.chunks import BUNDLED


def address(array) -> int:
    return np.asarray(array).__array_interface__["data"][0]


def test_a_block_comes_back_only_after_its_last_view_and_tensor_are_gone():
    size = 3 << 20
    block = run_buffers.take(size)
    at = address(block)
    part = torch.from_numpy(block[64:1 << 20]).view(torch.float16)[1:]  # a view of a view
    del block
    gc.collect()
    other = run_buffers.take(size)  # the first block is still seen through ``part``
    assert address(other) != at
    part.fill_(1)
    assert float(part[0]) == 1.0
    del part, other
    gc.collect()
    again = [run_buffers.take(size), run_buffers.take(size)]
    assert at in {address(a) for a in again}  # reused once nothing saw it


def test_decoding_into_reused_memory_gives_each_run_its_own_values():
    bufs, ids, _ = session(BUNDLED, [512] * 64, seed=3)
    other, other_ids, _ = session(BUNDLED, [512] * 64, seed=4)
    counts = [512] * 64
    want = {k: v.codes.clone() for k, v in decode_chunks(bufs, BUNDLED, ids, counts).items()}
    gc.collect()
    for _ in range(3):  # alternate sessions through the same memory
        got = decode_chunks(other, BUNDLED, other_ids, counts)
        del got
        gc.collect()
        got = decode_chunks(bufs, BUNDLED, ids, counts)
        for name, codes in want.items():
            assert torch.equal(got[name].codes, codes)
        del got
        gc.collect()
