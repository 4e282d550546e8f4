"""A client-streamed call's payloads, inline or through one leased shared-memory segment.

Spill and WriteChunks both send a first message, then one message per payload. On the
same host the payloads' bytes go into one segment leased for the call (its size known up
front) and each message names its range; else they travel inline, and a payload too big
for one message is ``InvalidRequest`` naming it. The segment is kept for the next call
once the server answered (it copied the bytes out before answering), released when the
call failed (the server may still be reading it), and closed when the caller was
cancelled (the server reaps its lease).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvstore.format.chunk import Buffer
from kvstore.format.errors import InvalidRequest
from kvstore.format.layout_bounds import MESSAGE_MARGIN
from kvtier.routing import Node
from proto import kvtier_pb2 as pb

Reply = TypeVar("Reply")


@dataclass(frozen=True)
class Item:
    what: str  # names it in an error: "chunk 3", "tail", "window"
    key: str  # Payload.key
    data: Buffer


async def upload(node: Node, first: object, items: Sequence[Item],
                 message: Callable[[Item, pb.Payload], object],
                 call: Callable[[AsyncIterator[object]], Awaitable[Reply]], *,
                 shared_memory: bool,
                 max_message_bytes: int, timeout_s: float | None) -> Reply:
    """``call`` with the stream ``first``, then ``message(item, payload)`` per item."""
    started = time.monotonic()
    segment = None
    if shared_memory and items:
        segment = await node.segments.for_spill(sum(len(i.data) for i in items), timeout_s)
    writer = segment.writer() if segment is not None else None
    too_big = [i for i in items if len(i.data) + MESSAGE_MARGIN > max_message_bytes]
    if too_big and writer is None:
        raise InvalidRequest(f"{too_big[0].what} of {len(too_big[0].data)} B exceeds the "
                             f"{max_message_bytes} B message limit and shared memory is off or "
                             "refused: raise max_message_bytes (client and server)")
    try:
        messages = [first]
        for item in items:
            payload = (pb.Payload(key=item.key, shm=writer.add(item.data)) if writer
                       else pb.Payload(key=item.key, data=bytes(item.data)))
            messages.append(message(item, payload))
        reply = await call(_stream(messages))
    except Exception:
        if segment is not None:  # the server may still be reading it: never reuse it
            await node.segments.release([segment])
        raise
    except BaseException:
        if segment is not None:  # cancelled: no call to release it, the server reaps it
            segment.close()
        raise
    if segment is not None:  # the server copied the bytes out before it answered
        await node.segments.keep(segment, started)
    return reply


async def _stream(messages: list[object]) -> AsyncIterator[object]:
    # An async iterator: with a plain one, a server refusing an oversize message
    # surfaces as INTERNAL instead of its RESOURCE_EXHAUSTED status.
    for message in messages:
        yield message
