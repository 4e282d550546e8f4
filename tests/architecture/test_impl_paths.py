"""The product files a Spill and a Resume run, as ``docs/impl.md`` lists them.

One durable-acked Spill (with a window), one Resume of it, and one Resume with replay (of
a session spilled without its window) go through the real gRPC servicer of an embedded
server with a host and a disk tier and the bundled model replaying in process.
``sys.settrace`` records the file of every frame that runs in the RPC's context: a
context variable set when the handler starts, which the tasks and worker threads it
starts inherit, so a background task of the server is not counted. Work handed to any
thread pool (the default executor, the replay worker's own compute thread) runs traced,
in the context of the code that handed it over. The Spill ends at the disk tier's index
commit of its manifest (``DiskIndex.apply`` of a ``MetaOp``), a Resume when its last
reply is sent. The messages are built before the call and sent by the raw stub, so the
client library is not on the path.

A spine is the call chain itself: the files on the stack, from the servicer's handler
down, at each marked step, together with the stacks that started the tasks and threads
it ran in (a task factory and the thread pools hand them down). The Spill's steps are
its disk index commits; a Resume with replay's are the store's plan, each block read
from a tier, the model's replay (on the replay worker's thread) and the manifest commit
that keeps the rebuilt window.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import re
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc

from kvstore.format.keys import chunk_digest, dedupe_scope
from kvstore.session.catalog import Catalog
from kvstore.session.resume import plan_window
from kvstore.tiers.disk.index import DiskIndex, MetaOp
from kvstore.tiers.host import HostTier
from kvtier.codec import as_tokens, encode_session, encode_window
from model.infer import replay_batch
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from services.server.servicer import KVTierServicer
from tests.support.fleet import fleet_servers, shared_config
from tests.support.service import (
    LAYOUT,
    ROOT,
    raw_spill_header,
    running_server,
    streams_for,
    tokens_for,
    window_for,
)

PRODUCT = ("kvtier", "kvstore", "services", "replay", "model", "kernels", "proto")
SPINE_BOUND = 12  # files on the call chain from the servicer to the disk commits
# every file a Spill runs today (the drain gate, the request's log and trace, the host
# tier's shared-memory slabs)
SPILL_BOUND = 43
REPLAY_SPINE_BOUND = 13  # files on the call chain of a Resume with replay
N = 2 * LAYOUT.chunk_tokens + 40
REF = pb.SessionRef(tenant="acme", session_id="s1")
DROPPED = pb.SessionRef(tenant="acme", session_id="s2")  # spilled without its window
IN_RPC: contextvars.ContextVar[bool] = contextvars.ContextVar("in_rpc", default=False)
# The spine: the files on the call stack of every task and thread that led to a frame,
# handed down when a task is created or work is submitted to a thread.
SPINE: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
    "spine", default=frozenset())
THREAD_SPINE = threading.local()


def product_file(frame) -> str | None:
    path = Path(frame.f_code.co_filename)
    if not path.is_relative_to(ROOT):
        return None
    rel = path.relative_to(ROOT)
    if rel.parts[0] in PRODUCT and not rel.name.endswith(("_pb2.py", "_pb2_grpc.py")):
        return rel.as_posix()
    return None


HANDLERS: set = set()  # the handlers' code: a spine starts at the servicer's method


def stack_files(frame) -> frozenset[str]:
    """The product files of ``frame``'s call stack up to the handler, and of the stacks it
    was started from."""
    files = set(SPINE.get()) | getattr(THREAD_SPINE, "files", frozenset())
    while frame is not None:
        if (name := product_file(frame)) is not None:
            files.add(name)
        if frame.f_code in HANDLERS:
            break
        frame = frame.f_back
    return frozenset(files)


def spine_task_factory(loop, coro, **kwargs):
    spine = stack_files(sys._getframe(1)) if IN_RPC.get() else frozenset()
    context = kwargs.pop("context", None) or contextvars.copy_context()
    context.run(SPINE.set, spine)
    return asyncio.Task(coro, loop=loop, context=context, **kwargs)


@contextlib.contextmanager
def followed_threads(trace) -> Iterator[None]:
    """Work submitted to any thread pool meanwhile runs traced by ``trace``, in the
    submitter's context, starting from the stack which submitted it: the replay worker's
    compute thread (started before the call) as much as the default executor's."""
    submit = concurrent.futures.ThreadPoolExecutor.submit

    def followed(pool, fn, /, *args, **kwargs):
        spine = stack_files(sys._getframe(1)) if IN_RPC.get() else frozenset()
        context = contextvars.copy_context()

        def run():
            THREAD_SPINE.files = spine
            sys.settrace(trace)
            try:
                return context.run(fn, *args, **kwargs)
            finally:
                sys.settrace(None)
                THREAD_SPINE.files = frozenset()
        return submit(pool, run)

    concurrent.futures.ThreadPoolExecutor.submit = followed
    try:
        yield
    finally:
        concurrent.futures.ThreadPoolExecutor.submit = submit


class PathTrace:
    """The product files run in an RPC's context from ``start`` (a handler's code) until
    ``stops`` (a frame) says the path ended."""

    def __init__(self, start, stops=lambda frame: False, marks=lambda frame: False) -> None:
        self.start, self.stops, self.marks = start, stops, marks
        HANDLERS.add(start)
        self.files: set[str] = set()
        self.spine: set[str] = set()  # the files on the stacks that led to a marked frame
        self.done = False

    def __call__(self, frame, event, arg):
        if event != "call" or self.done:
            return None
        if frame.f_code is self.start:
            IN_RPC.set(True)
        if not IN_RPC.get() or frame.f_code.co_name == "<module>":  # an import, not the path
            return None
        if (name := product_file(frame)) is not None:
            self.files.add(name)
        if self.marks(frame):
            self.spine |= stack_files(frame)
        if self.stops(frame):
            self.done = True
        return None


async def traced(trace: PathTrace, call) -> object:
    loop = asyncio.get_running_loop()
    factory = loop.get_task_factory()
    loop.set_task_factory(spine_task_factory)
    sys.settrace(trace)
    try:
        with followed_threads(trace):
            return await call()
    finally:
        sys.settrace(None)
        loop.set_task_factory(factory)


def documented(section: str) -> set[str]:
    """The files listed under ``## <section>`` in docs/impl.md (each a `path` in a table's
    first column)."""
    text = (ROOT / "docs" / "impl.md").read_text()
    body = text.split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `([\w/]+\.py)`", body, re.MULTILINE))


def _messages(header, enc, window: bytes):
    out = [pb.SpillRequest(header=header)]
    out += [pb.SpillRequest(chunk=pb.Payload(key=enc.keys[i], data=data))
            for i, data in sorted(enc.chunks.items())]
    return out + [pb.SpillRequest(tail=pb.Payload(data=enc.tail)),
                  pb.SpillRequest(window=pb.Payload(data=window))]


def _is_index_commit(frame) -> bool:
    return frame.f_code is DiskIndex.apply.__code__


def _is_manifest_commit(frame) -> bool:
    return (frame.f_code is DiskIndex.apply.__code__
            and any(isinstance(op, MetaOp) for op in frame.f_locals["ops"]))


REPLAY_STEPS = {plan_window.__code__, HostTier.get.__code__, HostTier.get_many_proven.__code__,
                replay_batch.__wrapped__.__code__, Catalog.put.__code__}  # under torch.no_grad


def _is_replay_step(frame) -> bool:
    """The store's plan, a block read from a tier, the model's replay, the manifest commit
    that keeps the rebuilt window."""
    return frame.f_code in REPLAY_STEPS


async def test_a_spill_and_a_resume_run_the_files_docs_impl_lists(tmp_path):
    tokens = as_tokens(tokens_for(N))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N), scope=dedupe_scope("acme"))
    window = encode_window(LAYOUT, tokens, window_for(LAYOUT, N))
    header = raw_spill_header(REF, tokens, enc, window_digest=chunk_digest(window),
                              ack=pb.ACK_DURABLE)
    messages = _messages(header, enc, window)
    windowless = [pb.SpillRequest(header=raw_spill_header(DROPPED, tokens, enc))] + \
        messages[1:-1]
    async with running_server(tmp_path, replay="in-process") as (server, target), \
            grpc.aio.insecure_channel(target) as channel:
        assert "disk" in [tier.name for tier in server.manager.tiers]
        stub = pb_grpc.KVTierStub(channel)
        spill = PathTrace(KVTierServicer.Spill.__wrapped__.__code__, _is_manifest_commit,
                          marks=_is_index_commit)
        reply = await traced(spill, lambda: stub.Spill(iter(messages)))
        assert reply.durable and reply.window_kept and spill.done

        async def resume() -> list:
            return [r async for r in stub.Resume(pb.ResumeRequest(session=REF))]
        resumed = PathTrace(KVTierServicer.Resume.__wrapped__.__code__)
        replies = await traced(resumed, resume)
        assert replies and not replies[-1].summary.replayed

        # (after the traced Spill: the disk tier's commit task is started by the first)
        await stub.Spill(iter(windowless))
        await server.servicer.replay.warm_up()  # the weights loaded, as a serving node has them

        async def resume_dropped() -> list:
            return [r async for r in stub.Resume(pb.ResumeRequest(session=DROPPED))]
        replayed = PathTrace(KVTierServicer.Resume.__wrapped__.__code__, marks=_is_replay_step)
        replies = await traced(replayed, resume_dropped)
        summary = replies[-1].summary
        assert summary.replayed and summary.replay_tokens == LAYOUT.replay_tokens
        kept = await server.manager.get_manifest("acme", "s2")
        assert kept.window_replayed == LAYOUT.replay_tokens  # kept: the last step ran

    assert "kvstore/tiers/disk/index.py" in spill.files  # it reached the commit
    assert sorted(spill.spine) == sorted(documented("The Spill path"))
    assert len(spill.spine) <= SPINE_BOUND, sorted(spill.spine)
    assert sorted(spill.files) == sorted(documented("Everything a Spill runs"))
    assert len(spill.files) <= SPILL_BOUND, sorted(spill.files)
    assert sorted(resumed.files) == sorted(documented("The Resume path"))
    # the replay ran on the worker's thread, and the tracer followed it there
    assert {"replay/worker.py", "model/infer.py", "model/net.py"} <= replayed.files
    assert sorted(replayed.spine) == sorted(documented("The Resume-with-replay path"))
    assert len(replayed.spine) <= REPLAY_SPINE_BOUND, sorted(replayed.spine)


async def test_an_adopted_window_runs_the_files_docs_impl_lists(
        tmp_path, s3_server, s3_bucket, s3_credentials, monkeypatch):
    """AdoptWindow on a fleet node (two servers on one moto bucket): node a spilled the
    session with its window, node b adopts it as a draining a would hand it over; from
    b's handler entry to its reply."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    tokens = as_tokens(tokens_for(N))
    enc = encode_session(LAYOUT, tokens, streams_for(LAYOUT, N), scope=dedupe_scope("acme"))
    window = encode_window(LAYOUT, tokens, window_for(LAYOUT, N))
    header = raw_spill_header(REF, tokens, enc, window_digest=chunk_digest(window),
                              ack=pb.ACK_DURABLE)

    def config(name: str):
        return shared_config(tmp_path, s3_server, s3_bucket, s3_credentials["region_name"],
                             name, listen="127.0.0.1:0", replay="off")

    async with fleet_servers(config, "ab") as nodes, \
            grpc.aio.insecure_channel(nodes["a"]) as on_a, \
            grpc.aio.insecure_channel(nodes["b"]) as on_b:
        assert (await pb_grpc.KVTierStub(on_a).Spill(iter(_messages(header, enc, window)))
                ).window_kept
        adoption = [pb.AdoptWindowRequest(header=pb.AdoptWindowHeader(
            session=REF, generation=1, from_node="a", window_digest=chunk_digest(window),
            window_bytes=len(window))), pb.AdoptWindowRequest(window=window)]
        adopted = PathTrace(KVTierServicer.AdoptWindow.__wrapped__.__code__)
        reply = await traced(adopted, lambda: pb_grpc.KVTierStub(on_b).AdoptWindow(
            iter(adoption)))
        assert reply.adopted and reply.node_id == "b"
    assert sorted(adopted.files) == sorted(documented("The AdoptWindow path"))
