"""The store's plan for a Restore's or a Resume's window (``kvstore.session.resume``):
which window is sent, whether and with what R it is rebuilt, whether that one is kept;
over a session reader stand-in whose window read is counted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvstore.format.registry import get_layout
from kvstore.session.manifest import window_coverage
from kvstore.session.resume import plan_window

SPEC = get_layout("kvtier-bundled")  # W = 128, stated R = 256
DEFAULT = 64  # the server's own default R, for a layout that states none


@dataclass
class Manifest:
    num_tokens: int = 1000
    window_key: str | None = None
    window_tier: str | None = None
    window_replayed: int = 0

    @property
    def window_coverage(self) -> int:
        return window_coverage(self.window_replayed, self.num_tokens)


class Reader:
    def __init__(self, manifest: Manifest, spec=SPEC, *, readable: bool = True) -> None:
        self.manifest, self.spec, self.readable, self.reads = manifest, spec, readable, 0

    async def window(self):
        self.reads += 1
        if self.manifest.window_key is None or not self.readable:
            return None, None
        return b"window", self.manifest.window_tier


def held(replayed: int = 0, tier: str = "host") -> Manifest:
    return Manifest(window_key="w", window_tier=tier, window_replayed=replayed)


async def plan(reader: Reader, **ask):
    return await plan_window(reader, default_replay_tokens=DEFAULT, **ask)


async def test_a_restore_sends_the_held_window_as_it_is_and_never_replays():
    reader = Reader(held(replayed=128))
    p = await plan(reader, resume=False, want_window=True, can_replay=True)
    assert p.window == b"window" and p.window_tier == "host" and p.window_held
    assert not p.replay and not p.replay_needed and p.replay_tokens == 0
    # not asked for: not read, reported held where the manifest names a tier
    reader = Reader(held(tier="hbm"))
    p = await plan(reader, resume=False, want_window=False)
    assert reader.reads == 0 and p.window is None and p.window_held and p.window_tier == "hbm"
    p = await plan(Reader(Manifest()), resume=False, want_window=True, can_replay=True)
    assert p.replay_needed and not p.replay and not p.window_held


async def test_a_resume_replays_the_layouts_stated_r_by_default_and_keeps_the_window():
    p = await plan(Reader(Manifest()), resume=True, can_replay=True)
    assert p.replay and p.replay_tokens == SPEC.replay_tokens == 256 and p.keep_window
    # a lost read (evicted since the manifest was read) replays too
    p = await plan(Reader(held(), readable=False), resume=True, can_replay=True)
    assert p.replay and p.window is None and not p.window_held
    # a layout that states no R: the server's default
    unstated = dataclasses.replace(SPEC, replay_tokens=0)
    p = await plan(Reader(Manifest(), unstated), resume=True, can_replay=True)
    assert p.replay_tokens == DEFAULT


async def test_a_window_of_a_shorter_replay_is_rebuilt_with_the_stated_r_where_one_can_replay():
    shorter = held(replayed=128)
    reader = Reader(shorter)
    p = await plan(reader, resume=True, can_replay=True)
    assert reader.reads == 0 and p.replay and p.replay_tokens == 256 and p.keep_window
    reader = Reader(shorter)  # nothing here replays: the held window, unchanged
    p = await plan(reader, resume=True, can_replay=False)
    assert reader.reads == 1 and p.window == b"window" and not p.replay
    # the engine's own window, or one as long as asked, is sent as held
    for replayed in (0, 256):
        p = await plan(Reader(held(replayed=replayed)), resume=True, can_replay=True)
        assert not p.replay and p.window == b"window"


async def test_a_shorter_r_is_honoured_and_its_window_kept_only_when_full():
    p = await plan(Reader(Manifest()), resume=True, replay_tokens=128, can_replay=True)
    assert p.replay and p.replay_tokens == 128 and p.keep_window  # a full W
    p = await plan(Reader(Manifest()), resume=True, replay_tokens=16, can_replay=True)
    assert p.replay and p.replay_tokens == 16 and not p.keep_window  # partial
    # a held window as long as the shorter R asks: no replay
    p = await plan(Reader(held(replayed=128)), resume=True, replay_tokens=128,
                   can_replay=True)
    assert not p.replay and p.window == b"window"
    # a larger R than the stated one rebuilds a window of the stated R
    p = await plan(Reader(held(replayed=256)), resume=True, replay_tokens=512,
                   can_replay=True)
    assert p.replay and p.replay_tokens == 512
