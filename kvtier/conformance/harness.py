"""What every conformance check is given (``Context``: a channel to the server under
test, the tenant, raw calls that collect replies and read error trailers) and how a
check fails (``Failed``, through ``expect``)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from kvstore.format.errors import ERROR_KEY
from kvstore.format.layout import LayoutSpec, layout_to_json
from kvtier.channel import Credentials, open_channel
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc

GRPC_DEFAULT_RECEIVE = 4 << 20  # gRPC's own receive limit, unless a client raises it


class Failed(Exception):
    """A check found the server off the spec; the message says how."""


def expect(condition: object, detail: str) -> None:
    if not condition:
        raise Failed(detail)


@dataclass
class Result:
    name: str
    ok: bool
    detail: str


Check = tuple[str, Callable[["Context"], Awaitable[str]]]  # name, check -> what it saw


@dataclass
class Replies:
    """A Restore / Resume stream as it came: ``kinds`` in order, payloads inline."""

    kinds: list[str] = field(default_factory=list)
    header: pb.SessionHeader | None = None
    chunks: list[pb.RestoredChunk] = field(default_factory=list)
    sections: list[pb.LayerSection] = field(default_factory=list)
    tails: list[bytes] = field(default_factory=list)
    windows: list[bytes] = field(default_factory=list)
    summary: pb.ResumeSummary | None = None

    def head(self) -> pb.SessionHeader:
        """The header; ``Failed`` when the stream sent none."""
        if self.header is None:
            raise Failed("the stream sent no header")
        return self.header


@dataclass
class Context:
    target: str
    credentials: Credentials
    tenant: str
    vectors: Path | None
    max_message_bytes: int  # the server's, as configured (the spec's default 8 MiB)
    receive_bytes: int = 64 << 20  # what this suite's own channel accepts
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    sessions: list[str] = field(default_factory=list)  # to delete at the end
    _channel: grpc.aio.Channel | None = None

    @property
    def stub(self) -> pb_grpc.KVTierStub:
        if self._channel is None:
            self._channel = self.channel(self.receive_bytes)
        return pb_grpc.KVTierStub(self._channel)

    def channel(self, receive_bytes: int) -> grpc.aio.Channel:
        """Another channel to the server, accepting messages up to ``receive_bytes``."""
        return open_channel(self.target, self.credentials, [
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.max_receive_message_length", receive_bytes)])

    def session_id(self, what: str) -> str:
        name = f"conformance-{self.run}-{what}"
        self.sessions.append(name)
        return name

    def ref(self, session_id: str) -> pb.SessionRef:
        return pb.SessionRef(tenant=self.tenant, session_id=session_id)

    async def register(self, spec: LayoutSpec) -> None:
        await self.stub.RegisterLayout(pb.RegisterLayoutRequest(layout_json=layout_to_json(spec)))

    async def register_json(self, layout: dict[str, Any]) -> str:
        reply: pb.RegisterLayoutReply = await self.stub.RegisterLayout(pb.RegisterLayoutRequest(
            layout_json=json.dumps(layout)))
        return reply.layout.layout_id

    async def spill(self, messages: Sequence[pb.SpillRequest]) -> pb.SpillReply:
        reply: pb.SpillReply = await self.stub.Spill(_stream(messages))
        return reply

    async def restore(self, session_id: str, *, stub: pb_grpc.KVTierStub | None = None,
                      **fields: Any) -> Replies:
        request = pb.RestoreRequest(session=self.ref(session_id), **fields)
        return await collect((stub or self.stub).Restore(request))

    async def refused(self, call: Awaitable[object], status: grpc.StatusCode, error: str | None
                      ) -> str:
        """``call`` must fail with ``status`` and a ``kvtier-error`` trailer naming
        ``error`` (None: no trailer, gRPC's own refusal); the failure's details."""
        try:
            await call
        except grpc.aio.AioRpcError as exc:
            trailer = dict(exc.trailing_metadata() or ()).get(ERROR_KEY)
            expect(exc.code() == status and trailer == error,
                   f"expected {status.name} {error or '(no trailer)'}, got "
                   f"{exc.code().name} {trailer or '(no trailer)'}: {exc.details()}")
            return exc.details() or ""
        raise Failed(f"expected {status.name} {error or ''}, the call succeeded")

    async def close(self) -> None:
        if self._channel is None:
            return
        for session_id in self.sessions:  # best effort: what this run made
            with contextlib.suppress(grpc.aio.AioRpcError):
                await self.stub.Delete(pb.DeleteRequest(session=self.ref(session_id)))
        await self._channel.close()


async def collect(call: AsyncIterator[pb.RestoreReply]) -> Replies:
    out = Replies()
    async for reply in call:
        kind = reply.WhichOneof("item")
        out.kinds.append(kind)
        if kind == "header":
            out.header = reply.header
        elif kind == "chunk":
            out.chunks.append(reply.chunk)
        elif kind == "section":
            out.sections.append(reply.section)
        elif kind == "tail":
            out.tails.append(reply.tail.data)
        elif kind == "window":
            out.windows.append(reply.window.data)
        elif kind == "summary":
            out.summary = reply.summary
    return out


async def _stream(messages: Sequence[pb.SpillRequest]) -> AsyncIterator[pb.SpillRequest]:
    for message in messages:
        yield message


async def run(checks: Sequence[Check], context: Context) -> list[Result]:
    """Every check in order, each on its own (one failing never stops the next)."""
    results = []
    try:
        for name, check in checks:
            try:
                results.append(Result(name, True, await check(context)))
            except Failed as exc:
                results.append(Result(name, False, str(exc)))
            except grpc.aio.AioRpcError as exc:
                results.append(Result(name, False, f"unexpected {exc.code().name}: "
                                                   f"{exc.details()}"))
            except Exception as exc:  # a reply this suite cannot even parse: a failure
                results.append(Result(name, False, f"{type(exc).__name__}: {exc}"))
    finally:
        await context.close()
    return results
