"""ArenaTier: the host tier in shared-memory slabs, with pins that keep a removed value's
bytes (and its slot) until the last reader lets go."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from kvstore.format.errors import TierFull
from kvstore.format.shm_names import PREFIX, SHM_DIR, available
from kvstore.tiers.arena import SLAB_BYTES, ArenaTier, Slot, fits_shared_memory
from tests.support.clock import ManualClock

pytestmark = pytest.mark.skipif(not available(), reason="no /dev/shm")

CHUNK = 1000
SCOPE = "tenant:acme"


def read(slot: Slot) -> bytes:
    return slot.arr.tobytes()


def slabs_of(pid: int) -> set[str]:
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"{PREFIX}{pid}-")}


@pytest.mark.parametrize("remove", ["delete", "overwrite", "expire"])
async def test_a_pinned_value_keeps_its_bytes_and_slot_until_unpinned(remove):
    clock = ManualClock()
    tier = ArenaTier(1 << 20, clock=clock)
    await tier.put("k", b"a" * CHUNK, ttl_s=10)
    slot = tier.pin_many(["k"], SCOPE)[0]
    assert slot is not None and slot.slab.scope == SCOPE and read(slot) == b"a" * CHUNK
    if remove == "delete":
        assert await tier.delete("k") == CHUNK
    elif remove == "overwrite":
        await tier.put("k", b"b" * CHUNK)
    else:
        clock.advance(11)
        assert not await tier.contains("k")
    held_after = CHUNK if remove == "overwrite" else 0
    assert tier.used_bytes == held_after + CHUNK  # the pinned bytes are still held
    for n in range(40):  # same-sized puts never take the pinned slot
        await tier.put(f"other{n}", b"c" * CHUNK)
        assert read(slot) == b"a" * CHUNK
    for n in range(40):
        await tier.delete(f"other{n}")
    tier.unpin(slot)
    assert tier.used_bytes == held_after
    assert slot.index not in slot.slab.taken  # freed once unpinned
    await tier.close()


async def test_an_unpinned_slot_is_reused_and_pins_never_cross_scopes():
    tier = ArenaTier(1 << 20)
    await tier.put("keeps-the-slab", b"0" * CHUNK)
    assert tier.pin_many(["keeps-the-slab"], SCOPE)[0] is not None
    await tier.put("k", b"a" * CHUNK)
    slot = tier.pin_many(["k"], SCOPE)[0]
    assert slot is not None
    assert tier.pin_many(["k"], "tenant:other")[0] is None  # its slabs are SCOPE's
    again = tier.pin_many(["k"], SCOPE)[0]
    assert again is slot and slot.pins == 2
    tier.unpin(again)
    await tier.delete("k")
    tier.unpin(slot)
    await tier.put("k2", b"z" * CHUNK)
    reused = tier.pin_many(["k2"], SCOPE)[0]
    assert reused is not None and (reused.slab, reused.index) == (slot.slab, slot.index)
    assert read(reused) == b"z" * CHUNK
    await tier.close()


async def test_a_view_handed_out_keeps_its_slot_until_dropped():
    tier = ArenaTier(1 << 20)
    await tier.put("k", b"a" * CHUNK)
    view = await tier.get("k")
    await tier.delete("k")
    assert tier.used_bytes == 0  # a reader's view is outside the accounting
    for n in range(10):
        await tier.put(f"o{n}", b"b" * CHUNK)
    assert bytes(view) == b"a" * CHUNK
    await tier.close()


async def test_slabs_are_private_bounded_and_unlinked_when_empty_and_at_close():
    capacity = 64 * CHUNK
    tier = ArenaTier(capacity)
    for n in range(64):
        await tier.put(f"k{n}", bytes([n]) * CHUNK)
    with pytest.raises(TierFull):  # value bytes fit no more
        await tier.put("one-more", b"x" * CHUNK)
    names = slabs_of(os.getpid())
    assert names
    for name in names:
        mode = os.stat(SHM_DIR / name, follow_symlinks=False).st_mode
        assert stat.S_IMODE(mode) == 0o600 and stat.S_ISREG(mode)
    assert tier.slab_bytes <= capacity + tier._slab_target + 4096
    for n in range(64):
        await tier.delete(f"k{n}")
    assert tier.slab_bytes == 0 and not slabs_of(os.getpid())
    await tier.put("k", b"x" * CHUNK)
    assert slabs_of(os.getpid())
    await tier.close()
    assert not slabs_of(os.getpid())


def test_a_killed_servers_slabs_are_removed():
    script = ("import asyncio, os, sys, time\n"
              "from kvstore.tiers.arena import ArenaTier\n"
              "tier = ArenaTier(1 << 20)\n"
              "asyncio.run(tier.put('k', b'x' * 1000))\n"
              "print('ready', flush=True)\n"
              "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert slabs_of(child.pid)
        child.send_signal(signal.SIGKILL)
        child.wait()
        deadline = time.monotonic() + 10
        while slabs_of(child.pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # the resource tracker notices and unlinks them
        assert not slabs_of(child.pid)
    finally:
        child.kill()


def test_a_tier_larger_than_dev_shm_does_not_fit_there():
    room = os.statvfs(SHM_DIR)
    free = room.f_bavail * room.f_frsize
    assert fits_shared_memory(1 << 20) == (free >= (1 << 20) + 4 * SLAB_BYTES)
    assert not fits_shared_memory(free)  # its slack would not fit: a write would SIGBUS
