"""The public client API: the blocking ``Client`` has each ``AsyncClient`` call's
signature and docstring, and no call returns a protobuf message (its annotation or its
value): every reply is a ``kvtier.types`` dataclass holding every field of the message
it stands for."""

from __future__ import annotations

import dataclasses
import inspect
import sys
import typing
from collections.abc import Callable
from typing import Any

import torch
from google.protobuf.message import Message

import kvtier
from kvtier import replies, types
from kvtier.client import AsyncClient
from kvtier.sync import Client
from proto import kvtier_pb2 as pb
from tests.support.service import LAYOUT, running_server, streams_for, tokens_for

TOKENS = 2 * LAYOUT.chunk_tokens + 8


def _public(cls: type) -> dict[str, Callable[..., Any]]:
    return {name: member for name, member in vars(cls).items()
            if callable(member) and (not name.startswith("_") or name == "__init__")}


def test_every_async_call_has_a_blocking_twin_with_its_signature_and_docstring():
    calls = _public(AsyncClient)
    assert set(calls) <= set(_public(Client))
    for name, async_call in calls.items():
        blocking = inspect.signature(getattr(Client, name))
        wanted = inspect.signature(async_call)
        # awaitable-ness aside: an async iterator's twin is an iterator
        returned = str(wanted.return_annotation).removeprefix("Async")
        assert blocking == wanted.replace(return_annotation=returned), name
        assert async_call.__doc__, f"AsyncClient.{name} has no docstring"
        assert getattr(Client, name).__doc__ == async_call.__doc__, name
    assert "servers" in inspect.signature(kvtier.Client).parameters


def _types_in(hint: Any) -> typing.Iterator[Any]:
    """``hint`` and every type inside it (arguments, dataclass fields), recursively."""
    yield hint
    for argument in typing.get_args(hint):
        yield from _types_in(argument)
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        # torch: imported by the dataclasses' modules for type checkers only
        for field_hint in typing.get_type_hints(hint, localns={"torch": torch}).values():
            yield from _types_in(field_hint)


def test_no_public_call_is_annotated_to_return_a_protobuf_message():
    for cls in (AsyncClient, Client):
        for name, call in _public(cls).items():
            # the return annotation only (a parameter's may name torch, not imported)
            returned = eval(call.__annotations__["return"], vars(sys.modules[call.__module__]))
            found = [t for t in _types_in(returned)
                     if isinstance(t, type) and issubclass(t, Message)]
            assert not found, f"{cls.__name__}.{name} returns {found}"


REPLIES = {types.SessionInfo: pb.SessionInfo, types.SessionRef: pb.SessionRef,
           types.TierStat: pb.TierStat, types.TenantUsage: pb.TenantUsage,
           types.NodeLiveness: pb.NodeLiveness, types.FleetStat: pb.FleetStat,
           types.StatResult: pb.StatReply, types.PrefetchResult: pb.PrefetchReply,
           types.EvictResult: pb.EvictReply, types.DeleteResult: pb.DeleteReply,
           types.ForkResult: pb.ForkReply, types.DrainProgress: pb.DrainProgress}


def test_each_reply_dataclass_holds_every_field_of_its_message():
    for cls, message in REPLIES.items():
        assert ([f.name for f in dataclasses.fields(cls)]
                == [f.name for f in message.DESCRIPTOR.fields]), cls.__name__


def test_a_reply_converts_nested_messages_maps_and_unset_fields():
    reply = pb.StatReply(
        tiers=[pb.TierStat(name="memory", used_bytes=5, available=True)], sessions=2,
        tenant_usage=pb.TenantUsage(tenant="acme", sessions_limit=3, rejections={"x": 1}))
    stat = replies.value(types.StatResult, reply)
    assert stat.tiers == [types.TierStat("memory", 0, 5, 0, True, 0, 0)]
    assert stat.session is None and stat.fleet is None  # left unset
    assert stat.tenant_usage is not None
    assert stat.tenant_usage.sessions_limit == 3
    assert stat.tenant_usage.durable_bytes_limit is None  # optional, unset: unlimited
    assert stat.tenant_usage.rejections == {"x": 1}


def _messages_in(value: Any) -> list[Any]:
    if isinstance(value, Message):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = [getattr(value, f.name) for f in dataclasses.fields(value)]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [m for item in value for m in _messages_in(item)]
    return []


async def test_no_public_call_returns_a_protobuf_message(tmp_path):
    tokens = tokens_for(TOKENS)
    async with running_server(tmp_path) as (_, target), AsyncClient(target) as kv:
        results = [
            await kv.spill("acme", "s1", LAYOUT.name, tokens, streams_for(LAYOUT, TOKENS),
                           generation=1),
            await kv.restore("acme", "s1"), await kv.resume("acme", "s1"),
            [piece async for piece in kv.restore_layers("acme", "s1")],
            await kv.layouts(), await kv.layout(LAYOUT.name),
            await kv.lookup("acme", LAYOUT.name, tokens),
            await kv.prefetch("acme", "s1"), await kv.evict("acme", "s1"),
            await kv.fork("acme", "s1", "s2", upto_tokens=LAYOUT.chunk_tokens),
            await kv.delete("acme", "s2"), await kv.drain()]
        stat, listed = await kv.stat("acme", "s1", usage_of="acme"), await kv.list("acme")
        results += [stat, listed]
        assert isinstance(stat, types.StatResult) and stat.session is not None
        assert stat.session.session == types.SessionRef("acme", "s1")
        assert {s.session.session_id for s in listed} == {"s1"}
        for result in results:
            assert not _messages_in(result), result
