"""``python -m kvtier.conformance`` against a real kvtier server: every check passes; and
against the same server modified (its restore stream, which Restore and ReadChunks both
reply through, drops the tail's sections in layer mode, or flips one byte of every
chunk), the checks that cover it fail."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys

from kvstore.format import registry as layouts
from kvtier.channel import Credentials
from kvtier.conformance import Context, all_checks, run
from kvtier.conformance.__main__ import report
from services.server.restore_stream import MESSAGE_MARGIN, RestoreStreamer
from tests.support.service import running_server

CONFORMANCE_LAYOUTS = ("kvtier-conformance", "kvtier-conformance-large", "wire-test")


@contextlib.contextmanager
def forgets_its_layouts():
    """The suite registers its layouts (and the vectors') into this process's registry,
    the server running in it: forget them afterwards, as other tests enumerate it."""
    try:
        yield
    finally:
        for name in CONFORMANCE_LAYOUTS:
            layouts._REGISTRY.pop(name, None)


class DropsTheTail(RestoreStreamer):
    """A restore stream off the spec: layer by layer, no section of the tail."""

    async def _sections(self, spec, buffers):
        async for section in super()._sections(spec, buffers):
            if section.chunk_index < len(buffers) - 1:
                yield section


class FlipsAByte(RestoreStreamer):
    """A restore stream off the spec: one bit of every whole chunk flipped."""

    def payload(self, key, data, writer, refused=""):
        payload = super().payload(key, data, writer, refused)
        if key and payload.WhichOneof("body") == "data":
            flipped = bytearray(payload.data)
            flipped[len(flipped) // 2] ^= 1
            payload.data = bytes(flipped)
        return payload


def broken(server, kind: type[RestoreStreamer]) -> None:
    """``kind`` serves Restore and Resume, and ReadChunks (whose calls hold the streamer
    they were built with, and build each chunk's payload with its ``payload``)."""
    old = server.servicer.streamer
    server.servicer.streamer = kind(old.manager, old.metrics, old.leases, old.replay,
                                    old.max_payload + MESSAGE_MARGIN, old.replayers,
                                    default_replay_tokens=old.default_replay_tokens)
    server.servicer.chunks.streamer = server.servicer.streamer


async def test_every_check_passes_against_the_server(tmp_path):
    with forgets_its_layouts():
        async with running_server(tmp_path) as (_, target):
            results = await run(all_checks(), Context(target, Credentials(), "conformance",
                                                      None, 8 << 20))
    assert [r for r in results if not r.ok] == []
    names = {r.name for r in results}
    assert {"golden vectors", "receive limit", "version 1 chunk refused in a Spill",
            "layer-by-layer restore: order, tail sections, checksums, digests",
            "prefix chunk golden vectors", "ReadChunks: expected digests"} <= names
    out = json.loads(report(results, as_json=True))
    assert out["failed"] == 0 and out["passed"] == len(results) == len(out["checks"])


async def test_the_suite_catches_a_server_that_drops_the_tail_or_flips_a_byte(tmp_path):
    with forgets_its_layouts():
        async with running_server(tmp_path) as (server, target):
            broken(server, DropsTheTail)
            dropped = await run(all_checks(), Context(target, Credentials(), "conformance",
                                                      None, 8 << 20))
            broken(server, FlipsAByte)
            flipped = await run(all_checks(), Context(target, Credentials(), "conformance",
                                                      None, 8 << 20))
    failed = {r.name: r.detail for r in dropped if not r.ok}
    assert set(failed) == {"layer-by-layer restore: order, tail sections, checksums, digests",
                           "layer-by-layer restore of zstd chunks", "golden vectors"}, failed
    assert "came out of order" in failed["layer-by-layer restore of zstd chunks"]
    failed = {r.name: r.detail for r in flipped if not r.ok}
    assert {"spill/restore round trip", "zstd chunks round trip", "golden vectors",
            "receive limit"} <= set(failed)
    assert "restored chunk 0 differs" in failed["spill/restore round trip"]
    read = {"ReadChunks: header, then chunks or MissingChunks in index order",
            "ReadChunks: first_chunk and max_chunks", "ReadChunks: expected digests",
            "prefix chunks and sessions dedupe both ways", "prefix chunk golden vectors"}
    assert read <= set(failed)
    assert "chunk 0's bytes are not of the header's digest" in \
        failed["ReadChunks: header, then chunks or MissingChunks in index order"]
    # what reads no chunk's bytes back is not affected
    assert not {"WriteChunks: chain keys from token 0 in the caller's scope",
                "WriteChunks: a partial last chunk refused",
                "WriteChunks: a chunk named by digest, not held, refused"} & set(failed)


async def test_the_command_line_exits_1_on_a_failure_and_prints_json(tmp_path):
    with forgets_its_layouts():
        async with running_server(tmp_path) as (_, target):
            proc = await asyncio_subprocess(sys.executable, "-m", "kvtier.conformance",
                                            "--server", target, "--json")
    out = json.loads(proc.stdout)
    assert proc.returncode == 0 and out["failed"] == 0 and out["passed"] >= 14


async def asyncio_subprocess(*argv: str) -> subprocess.CompletedProcess:
    import asyncio

    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 300)
    return subprocess.CompletedProcess(argv, proc.returncode, out.decode(), err.decode())
