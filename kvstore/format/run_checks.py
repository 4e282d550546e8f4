"""Checks of a run of restored chunks (a session's, as read from a tier), many at once.

``restored_run_checks(spec, tokens, first, keys)`` gives the ``TierStack.read`` check of
each chunk ``first + i`` under ``keys[i]``, the same as ``restored_chunk_check``'s, each
also carrying the run's ``RunCheck`` (``check.run``) and its chunk index
(``check.index``). ``RunCheck.many`` decides many of them in a few numpy calls: the digest
of each copy a tier has not proven, then every header and section table of the batch as one
structured array, against the layout's table and what the manifest says (layout, token
range, token ids), under the header's checksum. A copy the numpy
check does not accept gets the chunk's own check, which raises its specific error; a copy
is never accepted by ``many`` that its own check would refuse.

With ``independent`` each chunk is checked as the first chunk of a sequence of its own
tokens (proto "Independent chunks": start token 0).

A chunk given no key (None: a reader that skips the digest) is checked as
``restored_chunk_check`` without a key checks it: ``many`` hashes its payload against the
header's checksum too, so every byte is still checked.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from kvstore.format.checks import restored_chunk_check
from kvstore.format.chunk import FLAG_ZSTD, HEADER_DTYPE, MAGIC, SECTION_DTYPE, VERSION, Buffer
from kvstore.format.chunk_parts import chunk_plan
from kvstore.format.errors import ChunkCorrupt, CodecError
from kvstore.format.keys import chunk_digest, chunk_tokens_of, split_block_key, token_bytes
from kvstore.format.layout import LayoutSpec


class RunCheck:
    """The checks of chunks ``first .. first + len(keys) - 1`` of a session's tokens."""

    def __init__(self, spec: LayoutSpec, tokens: np.ndarray, first: int,
                 keys: Sequence[str | None], independent: bool = False) -> None:
        size = spec.chunk_tokens
        self.spec, self.tokens, self.first, self.keys = spec, tokens, first, keys
        self.independent = independent
        self._checks: dict[int, object] = {}  # each chunk's own check, made when needed
        self.plan = chunk_plan(spec, size, False)
        self.sections = len(self.plan.table_head)
        self.dtype = np.dtype([("head", HEADER_DTYPE), ("table", SECTION_DTYPE, (self.sections,)),
                               ("check", "<u8")])  # header, table, table check
        self.payload_offset = self.dtype.itemsize
        ids = np.frombuffer(token_bytes(tokens[first * size:(first + len(keys)) * size]),
                            np.uint8).reshape(-1, 4 * size)  # (chunks, 4 * size) uint8
        self.tokens_hashes = np.fromiter((xxhash.xxh3_64_intdigest(row.data) for row in ids),
                                         np.uint64, len(ids))

    def check(self, index: int) -> Any:  # restored_chunk_check's
        """Chunk ``index``'s own check (``restored_chunk_check``)."""
        check = self._checks.get(index)
        if check is None:
            check = self._checks[index] = restored_chunk_check(
                self.spec, *chunk_tokens_of(self.tokens, index, self.spec.chunk_tokens,
                                            self.independent), self.keys[index - self.first])
        return check

    def digest(self, index: int) -> bytes | None:
        key = self.keys[index - self.first]
        return None if key is None else split_block_key(key)[1]

    def many(self, indices: Sequence[int], values: Sequence[Buffer],
             proven: Sequence[bool]) -> list[CodecError | None]:
        """Per value (the copy of chunk ``indices[j]``, ``proven[j]``: its tier proved its
        digest) None when it passes its check, else the check's ``CodecError``."""
        errors: list[CodecError | None] = [None] * len(values)
        hashed = np.zeros(len(values), bool)  # no digest: the payload checksum is hashed
        for j, (index, value, sure) in enumerate(zip(indices, values, proven, strict=True)):
            digest = self.digest(index)
            hashed[j] = digest is None
            if not sure and digest is not None and chunk_digest(value) != digest:
                errors[j] = ChunkCorrupt(f"a copy of chunk {index} does not have the digest "
                                         "its key states")
        ok = self._headers_match(np.asarray(indices, np.int64), values, hashed)
        for j in np.flatnonzero(~ok).tolist():
            if errors[j] is None:
                check = self.check(indices[j])
                try:
                    (check if hashed[j] else check.proven)(values[j])
                except CodecError as exc:
                    errors[j] = exc
        return errors

    def _headers_match(self, indices: np.ndarray, values: Sequence[Buffer],
                       hashed: np.ndarray) -> np.ndarray:
        """(k,) bool: the value's header and section table are those of a version 2
        persistent chunk of this layout covering chunk ``indices[j]``'s tokens (the
        layout's table for them, under a checksum that holds), encoded for its token ids,
        and it has the length its header gives; where ``hashed[j]``, its payload has the
        header's payload checksum too."""
        if not len(values):
            return np.ones(0, bool)
        views = [memoryview(v).cast("B") for v in values]
        lens = np.fromiter(map(len, views), np.int64, len(views))
        top = self.payload_offset
        blank = bytes(top)
        raw = np.frombuffer(b"".join(v[:top] if len(v) >= top else blank for v in views),
                            np.uint8).reshape(len(views), top)  # (k, payload offset) uint8
        rows = raw.view(self.dtype).reshape(len(views))
        head, size = rows["head"], self.spec.chunk_tokens
        table = rows["table"].view(np.uint64).reshape(len(views), self.sections, 4)[:, :, :3]
        checks = np.fromiter(map(xxhash.xxh3_64_intdigest, raw[:, :top - 8]), np.uint64,
                             len(views))
        payloads = np.fromiter((xxhash.xxh3_64_intdigest(v[top:]) if must else 0
                                for v, must in zip(views, hashed.tolist(), strict=True)),
                               np.uint64, len(views))
        ok: np.ndarray = ((head["magic"] == MAGIC) & (head["version"] == VERSION)
                & ((head["flags"] & ~np.uint16(FLAG_ZSTD)) == 0)  # persistent, none unknown
                & (head["layout_hash"] == self.spec.layout_hash)
                & (head["start_token"] == (0 if self.independent else indices * size))
                & (head["num_tokens"] == size)
                & (head["sections"] == self.sections)
                & (head["raw_len"] == self.plan.payload_bytes)
                & (((head["flags"] & FLAG_ZSTD) != 0) | (head["stored_len"] == head["raw_len"]))
                & (lens == top + head["stored_len"].astype(np.int64))
                & (head["tokens_hash"] == self.tokens_hashes[indices - self.first])
                & (checks == rows["check"])
                & (~hashed | (payloads == head["payload_checksum"]))
                & (table == self.plan.table_head).all(axis=(1, 2)))
        return ok


class RunMember:
    """The check of one chunk of a ``RunCheck``: callable as, and with the ``proven`` form
    of, ``restored_chunk_check``'s."""

    __slots__ = ("run", "index")

    def __init__(self, run: RunCheck, index: int) -> None:
        self.run, self.index = run, index

    def __call__(self, data: Buffer) -> None:
        self.run.check(self.index)(data)

    def proven(self, data: Buffer) -> None:
        self.run.check(self.index).proven(data)


def restored_run_checks(spec: LayoutSpec, tokens: np.ndarray, first: int,
                        keys: Sequence[str | None]) -> list[RunMember]:
    """One check per key (see the module docstring): chunk ``first + i`` is ``keys[i]``."""
    run = RunCheck(spec, tokens, first, keys)
    return [RunMember(run, first + i) for i in range(len(keys))]
