"""HBMTier: device tensors (the CPU device here), read in place through get_tensor."""

from __future__ import annotations

import pytest
import torch

from kvstore.format.errors import ChunkNotFound, TierFull
from kvstore.tiers.hbm import HBMTier, serving_device


async def test_values_live_on_the_serving_device():
    tier = HBMTier(1 << 16)
    assert tier.device == serving_device()
    assert tier.holds_window and not tier.durable
    await tier.put("k", bytes(range(256)))
    stored = await tier.get_tensor("k")
    assert stored.device == serving_device()
    assert stored.dtype == torch.uint8 and stored.shape == (256,)
    assert stored.cpu().tolist() == list(range(256))
    assert bytes(await tier.get("k")) == bytes(range(256))


async def test_get_tensor_is_the_stored_value_not_a_copy():
    tier = HBMTier(1024)
    await tier.put("k", b"\x01" * 64)
    first = await tier.get_tensor("k")
    second = await tier.get_tensor("k")
    assert first.data_ptr() == second.data_ptr()


async def test_accounting_and_capacity():
    tier = HBMTier(256, device="cpu")
    await tier.put_tensor("a", torch.ones(200, dtype=torch.uint8))
    with pytest.raises(TierFull):
        await tier.put("b", b"x" * 57)
    await tier.put("b", b"x" * 56)
    assert tier.used_bytes == 256 == await tier.held_bytes()
    assert await tier.delete("a") == 200
    assert tier.used_bytes == 56
    with pytest.raises(ChunkNotFound):
        await tier.get_tensor("a")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_cuda_values_copy_to_host_on_get():
    tier = HBMTier(1024)
    await tier.put("k", b"abc")
    assert (await tier.get_tensor("k")).is_cuda
    assert bytes(await tier.get("k")) == b"abc"
