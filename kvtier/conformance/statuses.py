"""Refusals: the status and the ``kvtier-error`` trailer of malformed requests, a stale
generation, bytes without their stated digest, and a version 1 chunk in a Spill
(docs/wire-format.md sections 2.1, 6 and 8). Nothing refused is stored."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from kvstore.format.keys import chunk_digest
from kvtier.conformance.harness import Context, collect
from kvtier.conformance.sessions import LAYOUT, as_version_1, build
from proto import kvtier_pb2 as pb

INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


async def malformed(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 9)
    sid = ctx.session_id("malformed")
    header = session.header(ctx.ref(sid))
    cases: list[tuple[str, Callable[[], Awaitable[object]], grpc.StatusCode, str]] = [
        ("a payload before the header", lambda: ctx.spill(session.messages(header)[1:]),
         INVALID, "InvalidRequest"),
        ("an empty Spill", lambda: ctx.spill([]), INVALID, "InvalidRequest"),
        ("the header twice", lambda: ctx.spill([pb.SpillRequest(header=header)] * 2),
         INVALID, "InvalidRequest"),
        ("an unknown layout", lambda: ctx.spill(session.messages(
            session.header(ctx.ref(sid), layout_id="no-such-layout"))), INVALID,
         "UnknownLayout"),
        ("a tenant off its pattern", lambda: collect(ctx.stub.Restore(pb.RestoreRequest(
            session=pb.SessionRef(tenant="Bad Tenant", session_id="x")))), INVALID,
         "InvalidRequest"),
        ("replay_tokens over 8,192", lambda: collect(ctx.stub.Resume(pb.ResumeRequest(
            session=ctx.ref(sid), replay_tokens=9000))), INVALID, "InvalidRequest"),
        ("an unknown session", lambda: ctx.restore(sid), grpc.StatusCode.NOT_FOUND,
         "SessionNotFound"),
    ]
    for _, call, status, error in cases:
        await ctx.refused(call(), status, error)
    return "; ".join(f"{what}: {status.name} {error}" for what, _, status, error in cases)


async def stale_generation(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 10)
    sid = ctx.session_id("stale")
    await ctx.spill(session.messages(session.header(ctx.ref(sid), generation=2)))
    await ctx.refused(ctx.spill(session.messages(session.header(ctx.ref(sid), generation=1))),
                      PRECONDITION, "StaleGeneration")
    other = build(LAYOUT, 11, ctx.tenant, 11)
    await ctx.refused(ctx.spill(other.messages(other.header(ctx.ref(sid), generation=2))),
                      PRECONDITION, "GenerationConflict")
    return "an older generation is StaleGeneration, the same one with other content " \
           "GenerationConflict"


async def digest_mismatch(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 12)
    sid = ctx.session_id("digest")
    wrong = bytes(32)
    for changes in ({"chunk_digests": [wrong, *session.digests[1:]]},
                    {"tail_digest": wrong}, {"window_digest": wrong}):
        await ctx.refused(ctx.spill(session.messages(session.header(ctx.ref(sid), **changes))),
                          INVALID, "InvalidRequest")
    await ctx.refused(ctx.restore(sid), grpc.StatusCode.NOT_FOUND, "SessionNotFound")
    return "a chunk, the tail or the window under another digest: INVALID_ARGUMENT"


async def version_1_refused(ctx: Context) -> str:
    await ctx.register(LAYOUT)
    session = build(LAYOUT, 11, ctx.tenant, 13)
    old = as_version_1(session.chunks[0])
    session.chunks[0] = old
    session.digests[0] = chunk_digest(old)
    sid = ctx.session_id("version-1")
    details = await ctx.refused(ctx.spill(session.messages(session.header(ctx.ref(sid)))),
                                INVALID, "InvalidRequest")
    await ctx.refused(ctx.restore(sid), grpc.StatusCode.NOT_FOUND, "SessionNotFound")
    return f"a version 1 chunk is INVALID_ARGUMENT: {details[:120]}"


CHECKS = [("malformed requests: status and kvtier-error trailer", malformed),
          ("stale generation", stale_generation),
          ("digest mismatch refused", digest_mismatch),
          ("version 1 chunk refused in a Spill", version_1_refused)]
