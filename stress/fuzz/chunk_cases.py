"""The adversarial cases of WriteChunks and ReadChunks (prefix chunks of no session), for
``stress.fuzz.cases.CaseGenerator`` (its ``rng``, ``state``, ``_enc`` and ``_tenant``).

WriteChunks: honest writes of a pooled session's whole chunks (all, or from a later
``first_chunk``), a partial last chunk, payloads under a wrong or another tenant's key,
bytes that are not the stated digest, chunks named only by a digest the server may not
hold, a ``first_chunk`` past the tokens, huge token arrays, unknown layouts and domains.
ReadChunks: honest reads, huge token arrays and ``max_chunks``, a ``first_chunk`` past the
tokens, wrong expected digests, and another tenant's tokens (keys bind the scope: it reads
nothing of theirs). Every one must get a status, never an INTERNAL or a crash.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
from google.protobuf.descriptor import FieldDescriptor as F

from kvstore.format.keys import chunk_digest
from proto import kvtier_pb2 as pb
from stress.fuzz.layouts import HUGE_TOKENS
from stress.fuzz.messages import INTS, STRINGS
from stress.fuzz.pool import LAYOUT, Encoded
from stress.fuzz.state import TENANTS, Case, ser


class ChunkCases:
    rng: random.Random
    _enc: Callable[[], Encoded]
    _tenant: Callable[[], str]

    def adv_WriteChunks(self) -> Case:
        rng, enc, tenant = self.rng, self._enc(), self._tenant()
        kind = rng.choice(("honest", "honest", "later", "partial", "wrong_key", "foreign_key",
                           "bad_digest", "by_digest", "past", "huge", "names"))
        whole = len(enc.chunks)
        tokens = enc.tokens[:whole * LAYOUT.chunk_tokens]
        first = rng.randrange(whole) if kind == "later" and whole else 0
        chunks = list(enc.chunks[first:])
        keys = enc.keys(tenant)[first:]
        digests = [chunk_digest(c) for c in chunks]
        header = dict(tenant=tenant, layout_id=LAYOUT.name, token_ids=tokens.tobytes(),
                      first_chunk=first, chunk_digests=digests,
                      ack=rng.choice((pb.ACK_MEMORY, pb.ACK_DURABLE)))
        if kind == "partial":
            header["token_ids"] = enc.tokens.tobytes() + b"\x01\x00\x00\x00"
        elif kind == "wrong_key" and keys:
            keys = keys[::-1] if len(keys) > 1 else ["0" * 32]
        elif kind == "foreign_key":
            other = rng.choice([t for t in TENANTS if t != tenant])
            keys = enc.keys(other)[first:]
        elif kind == "bad_digest" and chunks:
            chunks[0] = chunks[0][:-1] + bytes([chunks[0][-1] ^ 1])
        elif kind == "by_digest":
            chunks = []  # named by digest alone: refused unless every one is held
        elif kind == "past":
            header["first_chunk"] = rng.choice(INTS[F.TYPE_UINT32])
        elif kind == "huge":
            header["token_ids"] = np.zeros(rng.choice(HUGE_TOKENS), "<u4").tobytes()
        elif kind == "names":
            header["layout_id"] = rng.choice(STRINGS)
            header["dedupe_domain"] = rng.choice(("public", *TENANTS, *STRINGS))
        messages = [pb.WriteChunksRequest(header=pb.WriteChunksHeader(**header))]
        messages += [pb.WriteChunksRequest(chunk=pb.Payload(key=key, data=data))
                     for key, data in zip(keys, chunks, strict=False)]
        return Case("WriteChunks", f"write_chunks:{kind}", ser(messages))

    def adv_ReadChunks(self) -> Case:
        rng, enc, tenant = self.rng, self._enc(), self._tenant()
        kind = rng.choice(("honest", "honest", "range", "huge", "max", "past", "digests",
                           "foreign", "shm"))
        request = pb.ReadChunksRequest(tenant=tenant, layout_id=LAYOUT.name,
                                       token_ids=enc.tokens.tobytes())
        if kind == "range":
            request.first_chunk = rng.randrange(len(enc.chunks) + 1)
            request.max_chunks = rng.randrange(3)
        elif kind == "huge":
            request.token_ids = np.zeros(rng.choice(HUGE_TOKENS), "<u4").tobytes()
        elif kind == "max":
            request.max_chunks = rng.choice(INTS[F.TYPE_UINT32])
        elif kind == "past":
            request.first_chunk = rng.choice(INTS[F.TYPE_UINT32])
        elif kind == "digests":
            request.chunk_digests.extend(rng.randbytes(rng.choice((0, 1, 32, 64)))
                                         for _ in range(rng.randrange(4)))
        elif kind == "foreign":
            request.tenant = rng.choice([t for t in TENANTS if t != tenant])
        elif kind == "shm":
            request.use_shared_memory = True
            request.reply_lease = rng.choice(("", "x" * 64, *STRINGS))
        return Case("ReadChunks", f"read_chunks:{kind}", ser([request]))
