"""The server's replies as the client's Python values: the Restore / Resume reply stream's
parts collected (payloads copied out of shared memory) and turned into a
``RestoredSession``; a control call's reply into its ``kvtier.types`` dataclass
(``value``). No retries here (``kvtier.client`` owns the calls)."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from google.protobuf.message import Message

from kvstore.format.chunk import StreamData
from kvstore.format.chunk_run import PackedRun
from kvstore.format.errors import InvalidRequest
from kvstore.format.keys import block_key
from kvstore.format.layout import LayoutSpec
from kvstore.format.model_identity import check_model
from kvtier import codec as cc
from kvtier import shm
from kvtier.types import RestoredSession
from proto import kvtier_pb2 as pb

Value = TypeVar("Value")
Body = bytes | memoryview  # a payload's bytes, copied out of shared memory or inline
Part = Body | pb.SharedMemoryRef  # a payload as it came


def value(cls: type[Value], message: Message) -> Value:
    """``message`` as the dataclass ``cls`` whose fields bear its fields' names: nested
    messages as their dataclasses, repeated fields as lists, maps as dicts, and a
    submessage or optional field the message left unset as None."""
    fields: dict[str, Any] = {}
    for name, optional, shape, item in _plan(typing.cast(Any, cls)):
        raw = getattr(message, name)
        if optional and not message.HasField(name):
            fields[name] = None
        elif shape == "list":
            fields[name] = [value(item, m) for m in raw] if item else list(raw)
        elif shape == "dict":
            fields[name] = dict(raw)
        elif shape == "message":
            fields[name] = value(item, raw)
        else:
            fields[name] = raw
    return cls(**fields)


@functools.cache
def _plan(cls: Any) -> tuple[tuple[str, bool, str, Any], ...]:
    """Per field of the dataclass ``cls``: (name, whether it is ``X | None``, its shape:
    "list", "dict", "message" or "scalar", and the dataclass a list holds or a message
    is, else None). Resolving type hints costs ~100 us: once per class, not per reply."""
    hints = typing.get_type_hints(cls)
    plan = []
    for field in dataclasses.fields(cls):
        hint = hints[field.name]
        args = typing.get_args(hint)
        optional = isinstance(hint, types.UnionType) and type(None) in args
        if optional:
            hint = next(a for a in args if a is not type(None))
        origin = typing.get_origin(hint)
        if origin is list:
            (item,) = typing.get_args(hint)
            is_message = isinstance(item, type) and dataclasses.is_dataclass(item)
            plan.append((field.name, optional, "list", item if is_message else None))
        elif origin is dict:
            plan.append((field.name, optional, "dict", None))
        elif isinstance(hint, type) and dataclasses.is_dataclass(hint):
            plan.append((field.name, optional, "message", hint))
        else:
            plan.append((field.name, optional, "scalar", None))
    return tuple(plan)


def copied_out(segment: shm.Segment | None, chunks: list[Part], tail: Part
               ) -> tuple[Sequence[Body], Body]:
    """Chunks and tail that came as shared memory refs, copied out of ``segment``: chunks
    lying back to back (with the tail after them) as one ``PackedRun``, in one copy,
    which the decode reads without joining them; else each on its own."""
    refs = [c for c in chunks if isinstance(c, pb.SharedMemoryRef)]
    if segment is not None and refs and len(refs) == len(chunks):
        if isinstance(tail, pb.SharedMemoryRef):
            run = segment.read_run([*refs, tail])
            if run is not None:
                return PackedRun(run.buffer.data, run.lengths[:-1].tolist()), run[-1]
        run = segment.read_run(refs)
        if run is not None:
            return run, _body(segment, tail)
    return [_body(segment, c) for c in chunks], _body(segment, tail)


def _body(segment: shm.Segment | None, part: Part) -> Body:
    """``part``'s bytes: copied out of ``segment`` when it came as a ref to it."""
    if not isinstance(part, pb.SharedMemoryRef):
        return part
    if segment is None:
        raise InvalidRequest("a reply refers to shared memory the header did not name")
    return segment.read(part)


async def collect(call: Any, segments: shm.ClientSegments, used: list[shm.Segment],  # noqa: C901 - one reply stream's items, each a case
                  persistent: Callable[[pb.SessionHeader, Sequence[Body], Body],
                                       Awaitable[None]],
                  stated: str) -> tuple[pb.SessionHeader, Sequence[Body], Body, Body | None,
                                        pb.ResumeSummary, shm.Segment | None]:
    """The reply stream's parts, payloads copied out of shared memory; the segment the
    header named (mapped, and added to ``used``, unless it is the offered one).
    ``persistent(header, chunks, tail)`` is awaited once, as soon as every chunk and
    the tail have come (before the window, which a Resume may still be replaying).
    ``stated``: the caller's model fingerprint, checked against the header's here too
    (a server that predates the check would not refuse)."""
    header: pb.SessionHeader | None = None
    received: list[Part] = []
    tail: Part = b""
    window: Body | None = None
    summary = pb.ResumeSummary()
    segment: shm.Segment | None = None
    copied: tuple[Sequence[Body], Body] | None = None  # once every chunk and the tail came
    try:
        async for reply in call:
            kind = reply.WhichOneof("item")
            if kind == "header":
                header = reply.header
                check_model(stated, header.model_fingerprint, "the restored session")
                if header.HasField("reply_segment"):
                    segment = await reply_segment(segments, header.reply_segment, used)
            elif kind == "summary":
                summary = reply.summary
            else:
                payload = reply.chunk.payload if kind == "chunk" else getattr(reply, kind)
                data: Part
                if payload.WhichOneof("body") != "shm":
                    data = payload.data
                elif segment is None:
                    raise InvalidRequest("a reply refers to shared memory the header "
                                         "did not name")
                elif kind in ("chunk", "tail"):
                    data = payload.shm  # copied out below, all in one copy
                else:
                    data = segment.read(payload.shm)
                if kind == "chunk":
                    received.append(data)
                elif kind == "tail":
                    tail = data
                else:
                    window = _body(segment, data)
                if (copied is None and header is not None and kind != "window"
                        and len(received) == len(header.chunk_keys)
                        and (kind == "tail" or not header.tail_digest)):
                    copied = copied_out(segment, received, tail)
                    await persistent(header, *copied)
        if copied is None and header is not None:  # none came, or not all
            copied = copied_out(segment, received, tail)
            await persistent(header, *copied)
    except BaseException:
        call.cancel()
        raise
    if header is None or copied is None:
        raise InvalidRequest("the reply stream sent no header")
    return header, copied[0], copied[1], window, summary, segment


async def reply_segment(segments: shm.ClientSegments, lease: pb.SharedMemoryLease,
                        used: list[shm.Segment]) -> shm.Segment:
    """The segment a reply header names: the one offered (``used[0]``), else mapped and
    added to ``used``."""
    if used and used[0].lease_id == lease.lease_id:
        return used[0]  # the offered one, written into
    segment = await segments.mapped(lease)
    used.append(segment)
    return segment

def restored_session(spec: LayoutSpec, header: pb.SessionHeader, chunks: Sequence[Body],
                     tail: Body, window: Body | None, summary: pb.ResumeSummary,
                     persistent: dict[str, StreamData] | None) -> RestoredSession:
    """The session; ``persistent``: its decoded persistent streams, None (no decode)."""
    tokens = cc.as_tokens(np.frombuffer(header.token_ids, dtype="<u4"))
    streams, start = None, 0
    if window is not None:
        cc.check_window_digest(window, summary.window_digest if summary.replayed
                               else header.window_digest)
        start = cc.window_start(window)
        if persistent is not None:
            streams, start = cc.decode_window(spec, tokens, window)
    return RestoredSession(
        layout=spec, generation=header.generation, token_ids=tokens,
        # block keys (chain key + digest), as the server stores the chunks
        chunk_keys=[block_key(k, d) for k, d in zip(header.chunk_keys, header.chunk_digests,
                                                     strict=True)],
        chunks=chunks, tail=tail, window_blob=window,
        persistent={} if persistent is None else persistent,
        window=streams, window_start=start, window_tier=header.window_tier,
        replay_needed=window is None and bool(spec.ephemeral_streams),
        replayed=summary.replayed, replay_tokens=summary.replay_tokens, tier=summary.tier,
        restore_seconds=summary.restore_seconds, replay_seconds=summary.replay_seconds,
        writeback_failed=header.writeback_failed, model_fingerprint=header.model_fingerprint,
        window_replayed_tokens=(summary.replay_tokens if summary.replayed
                                else header.window_replayed_tokens))
