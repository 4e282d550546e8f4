"""Crash safety of ``kvtier compact``: SIGKILLed at random moments, a rerun completes, every
session that was live before restores byte-identical, and nothing referenced is ever
removed (checked after every kill, before the rerun).

Each round copies a pristine data directory (filled by the real server: shared prefixes,
deleted sessions for dead bytes, an expiring session, idle sessions to demote), runs
the real command (``services.cli.main.main``) in a child process and kills it a random delay
after a random one of its log lines, once or twice, then reruns it to completion.

The children come from a fork server that has imported the command once, so a kill
lands in the job's work, not in its start-up. They are not forked from this process: it
has run gRPC servers, and a fork of a process with gRPC threads can crash in the child.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import random
import shutil
import signal
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path

import pytest

from kvstore.compaction.sessions import load_manifests
from kvstore.format.chunk import verify_chunk
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.object import ObjectTier
from services import cli
from tests.support.compaction import HOUR, SPECS, Snapshot, Spec, fill_idle_and_hot, restore_all

CRASH_SPECS = (*SPECS, Spec("t", 3, prefix_of="a", ttl_s=HOUR))
HOT = ("a", "b", "g")  # spilled again after a pause: the others are idle and get demoted
LOG_LINES = 11  # a run logs the sealed segment and each of five steps' start and end
REWRITE_LINE = 10  # "rewrite segments: N to do": the rewrite runs for ~10 ms after it
# Kill points: after any line, and more often just into the rewrite (before its switch,
# during it, or before the old files are removed).
POINTS = [*range(LOG_LINES + 1), *[REWRITE_LINE] * 4]


class Pristine:
    def __init__(self, root: Path) -> None:
        self.data = root / "pristine"
        self.snaps, hot_since = asyncio.run(fill_idle_and_hot(
            self.data, specs=CRASH_SPECS, delete=("d", "f"), hot=HOT))
        del self.snaps["t"]  # every run expires it by its TTL
        # An hour after the hot sessions' last spill: the others are demoted, hot ones stay.
        self.as_of = hot_since + HOUR

    def argv(self, work: Path) -> list[str]:
        return ["compact", "--data-dir", str(work), "--json",
                "--demote-after", "1h", "--as-of", repr(self.as_of)]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Pristine:
    return Pristine(tmp_path_factory.mktemp("compact-crash"))


# A fresh interpreter that preloads the command and forks a child per run.
FORK_SERVER = multiprocessing.get_context("forkserver")
FORK_SERVER.set_forkserver_preload(["services.cli.main", "services.cli.compact",
                                    "kvstore.compaction.job", "tests.compaction.test_crash"])


def run_cli(argv: list[str], log: Connection | None) -> None:
    """The child: the command, its log lines (one per step start and end) to ``log``."""
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null if log is None else log.fileno(), 2)
    sys.exit(cli.main(argv))


def start_compact(argv: list[str], log: Connection | None = None) -> BaseProcess:
    child = FORK_SERVER.Process(target=run_cli, args=(argv, log))
    child.start()
    return child


def kill_after(child: BaseProcess, log: Connection, lines: int, delay: float) -> None:
    """SIGKILL the child ``delay`` seconds after its ``lines``-th log line (or its end)."""
    seen = 0
    while seen < lines:
        chunk = os.read(log.fileno(), 65536)
        if not chunk:
            break
        seen += chunk.count(b"\n")
    time.sleep(delay)
    child.kill()


def exit_code(child: BaseProcess) -> int:
    """The child's exit status; minus the signal's number when a signal ended it."""
    child.join(timeout=120)
    assert child.exitcode is not None, "the compaction hangs"
    return child.exitcode


async def check_store(data: Path, snaps: dict[str, Snapshot]) -> None:
    """Every live session's manifest is intact and each chunk it names has an intact,
    identical copy in the disk or the object tier."""
    disk = DiskTier(data / "disk", 1 << 30, writer=False)
    objects = ObjectTier(data / "objects", 1 << 40)
    try:
        manifests = {m.session_id: m for m in await load_manifests(disk.meta)}
        for name, snap in snaps.items():
            manifest = manifests[name]
            assert manifest.token_ids.tobytes() == snap.token_ids
            assert manifest.chunk_keys == snap.chunk_keys and manifest.tail == snap.tail
            for key, want in zip(manifest.chunk_keys, snap.chunks, strict=True):
                tier = disk if await disk.contains(key) else objects
                got = bytes(await tier.get(key))
                verify_chunk(got)
                assert got == want, f"{name}: chunk {key} differs in {tier.name}"
    finally:
        await disk.close()


def killed_run(argv: list[str], rng: random.Random) -> tuple[int, float] | None:
    """One run killed at a random point: after a random number of its log lines (0 to
    all of them, ``POINTS``) plus a random delay. (lines, delay) if the kill landed, None if the
    run had finished first."""
    reader, writer = FORK_SERVER.Pipe(duplex=False)
    try:
        child = start_compact(argv, writer)
        writer.close()  # the child holds its copy: the reader sees EOF when it ends
        lines = rng.choice(POINTS)
        point = lines, rng.uniform(0.0, 0.015 if lines == REWRITE_LINE else 0.03)
        kill_after(child, reader, *point)
        return point if exit_code(child) == -signal.SIGKILL else None
    finally:
        reader.close()


def crash_rounds(pristine: Pristine, root: Path, kills_wanted: int, seed: int
                 ) -> list[tuple[int, float]]:
    rng = random.Random(seed)
    kills: list[tuple[int, float]] = []
    work = root / "work"
    rounds = 0
    while len(kills) < kills_wanted:
        rounds += 1
        assert rounds <= 3 * kills_wanted, "the job keeps finishing before the kill"
        shutil.rmtree(work, ignore_errors=True)
        shutil.copytree(pristine.data, work)
        for _ in range(rng.choice((1, 1, 2))):  # sometimes the rerun is killed too
            point = killed_run(pristine.argv(work), rng)
            if point is not None:
                kills.append(point)
            asyncio.run(check_store(work, pristine.snaps))
        assert exit_code(start_compact(pristine.argv(work))) == 0, "the rerun did not complete"
        asyncio.run(check_store(work, pristine.snaps))
    # Finally, through the real server: byte-identical restores of every live session.
    assert asyncio.run(restore_all(work, list(pristine.snaps))) == pristine.snaps
    return kills


def test_a_few_kills_then_a_rerun(pristine, tmp_path):
    kills = crash_rounds(pristine, tmp_path, kills_wanted=3, seed=1)
    assert len(kills) >= 3


def test_twenty_kills_at_random_moments(pristine, tmp_path):
    kills = crash_rounds(pristine, tmp_path, kills_wanted=20, seed=2)
    assert len(kills) >= 20 and len({lines for lines, _ in kills}) >= 6  # spread over steps
