"""The prefix-reuse RPCs (Lookup, Fork) of ``KVTierServicer``, a mixin over its
``manager`` and ``config``: validated (``services.server.validate``), the tenant checked
against the caller's (``services.server.auth``), then one manager call each."""

from __future__ import annotations

import grpc

from kvstore.keys import split_block_key
from kvstore.manager import TierManager
from kvtier.errors import grpc_errors
from proto import kvtier_pb2 as pb
from services.server import auth
from services.server import validate as check
from services.server.config import ServerConfig

MAX_TOKENS = 1 << 26  # as the servicer's


class PrefixRPCs:
    manager: TierManager
    config: ServerConfig

    @grpc_errors
    async def Lookup(self, request: pb.LookupRequest, context: grpc.aio.ServicerContext
                     ) -> pb.LookupReply:
        tenant, layout_id, tokens, fingerprint, domain = check.lookup_request(
            request, MAX_TOKENS, self.config.dedupe_domains)
        auth.check_tenant(tenant)
        found = self.manager.lookup(tenant, layout_id, tokens, model_fingerprint=fingerprint,
                                    dedupe_domain=domain)
        chunks = []
        for chunk in found.chunks:
            chain, digest = split_block_key(chunk.block_key)
            chunks.append(pb.HeldChunk(chunk_key=chain, digest=digest, tiers=chunk.tiers))
        return pb.LookupReply(tokens_held=found.tokens_held, chunks_held=len(chunks),
                              chunks=chunks)

    @grpc_errors
    async def Fork(self, request: pb.ForkRequest, context: grpc.aio.ServicerContext
                   ) -> pb.ForkReply:
        tenant, source, new, upto = check.fork_request(request)
        auth.check_tenant(tenant)
        manifest = await self.manager.fork(tenant, source, new, upto_tokens=upto)
        return pb.ForkReply(generation=manifest.generation, num_tokens=manifest.num_tokens,
                            chunks=len(manifest.chunk_keys),
                            window_kept=manifest.window_key is not None)
