"""The replay protocol's messages: a ``ReplayRequest`` made (``replay_request``) and read
back (``decode_request``), their bound, and what serves them (``Worker``). Shared by the
worker's gRPC service, its remote client and the Redis Streams fan-out.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Protocol

import numpy as np

from kvstore.format.errors import InvalidRequest, shown
from kvstore.format.keys import check_fingerprint
from kvstore.format.layout import LayoutSpec, layout_to_json
from kvstore.format.layout_bounds import parse_layout
from proto import kvtier_pb2 as pb
from replay.state_codec import Buffer, as_token_array
from replay.worker import ReplayResult

MAX_MESSAGE_BYTES = 64 << 20


class Worker(Protocol):
    """What a replay worker serves with: ``replay.worker.ReplayWorker`` (the bundled model) or
    ``replay.transformers_worker.TransformersReplayWorker`` (``--hf-model``)."""

    max_batch: int  # jobs a Streams consumer takes at once
    replayer: str  # kvstore.format.layout.REPLAYERS: the layouts it rebuilds
    model_fingerprint: str  # of the model it loaded (kvstore.format.model_identity)

    async def rebuild(self, layout: str | LayoutSpec, token_ids, chunks, tail,
                      replay_tokens: int | None = None, *,
                      model_fingerprint: str = "") -> ReplayResult: ...

    async def close(self) -> None: ...


def decode_request(request: pb.ReplayRequest, max_message_bytes: int = MAX_MESSAGE_BYTES
                   ) -> tuple[str | LayoutSpec, np.ndarray, list[bytes]]:
    """The request's layout, token ids ((n,) uint32) and chunks, checked for shape only
    (and its model fingerprint for length: the worker compares it with its own).
    The layout is the spec its ``layout_json`` spells (bounded as RegisterLayout bounds
    it, and it must be ``layout_id``'s), so a layout registered only on the server
    replays here; without one, the id for the worker to resolve."""
    check_fingerprint(request.model_fingerprint)
    if len(request.token_ids) % 4:
        raise InvalidRequest(f"token_ids must be little-endian uint32 values; got "
                             f"{len(request.token_ids)} bytes")
    layout: str | LayoutSpec = request.layout_id
    if request.layout_json:
        layout = parse_layout(request.layout_json, max_message_bytes)
        if request.layout_id and layout.layout_id != request.layout_id:
            raise InvalidRequest(f"layout_json is layout {layout.layout_id}, not "
                                 f"{shown(request.layout_id)}")
    return layout, np.frombuffer(request.token_ids, dtype="<u4"), list(request.chunks)


def replay_request(layout: str | LayoutSpec, token_ids, chunks: Sequence[Buffer],
                   tail: Buffer, replay_tokens: int | None, model_fingerprint: str = ""
                   ) -> pb.ReplayRequest:
    """The request for ``layout`` (an id, or a spec: then its canonical JSON travels with
    it, so a worker needs no registry of its own), of a session spilled by
    ``model_fingerprint`` (the worker refuses other weights')."""
    layout_id = layout.layout_id if isinstance(layout, LayoutSpec) else layout
    layout_json = layout_to_json(layout) if isinstance(layout, LayoutSpec) else ""
    if replay_tokens is not None and not 0 <= replay_tokens < 1 << 32:
        raise InvalidRequest(f"replay_tokens must be a non-negative integer, got {replay_tokens}")
    return pb.ReplayRequest(layout_id=layout_id, token_ids=as_token_array(token_ids).tobytes(),
                            chunks=[bytes(c) for c in chunks], tail=bytes(tail),
                            replay_tokens=replay_tokens or 0, job_id=uuid.uuid4().hex,
                            layout_json=layout_json,
                            model_fingerprint=check_fingerprint(model_fingerprint))
