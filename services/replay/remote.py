"""A replay backend that calls ``kvtier replay-worker`` processes over gRPC.

    backend = RemoteReplay(["10.0.0.7:50052", "10.0.0.8:50052"])
    result = await backend.rebuild(layout_id, token_ids, chunks, tail, replay_tokens)
    await backend.close()

Same call and result as ``ReplayWorker.rebuild``. Workers are taken in turn; one that is
down or too slow (UNAVAILABLE, or no answer within ``timeout_s``: DEADLINE_EXCEEDED)
hands the job to the next, and only when every worker failed does the call raise
``TierUnavailable``. Each worker has a circuit breaker (``kvstore.remote.breaker``, dependency
``replay:<address>``, cool-down ``breaker_cooldown_s``): one that failed so is skipped
without a call until its cool-down ends and one call probes it again, so a stalled worker
costs one ``timeout_s``, not one per job. Any other failure is the
worker's verdict on the request and is raised as the ``kvstore.format.errors`` class it named
(``kvtier.errors.error_from_rpc``). ``credentials`` (``kvtier.channel``): TLS towards the
workers and the bearer token of role ``replay`` they check, from the server's
``replay_tls_*`` and ``replay_token_file`` settings (``replay_backend.credentials_from``).
``probe()`` asks every worker's gRPC health through its breaker (the server's prober calls
it every ``probe_interval_s``), so an idle server knows when its workers are back.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.format.errors import InvalidRequest, TierUnavailable
from kvstore.format.layout import LayoutSpec
from kvstore.remote.breaker import CircuitBreaker
from kvtier.channel import Credentials, open_channel
from kvtier.errors import error_from_rpc
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from replay.state_codec import Buffer
from replay.worker import ReplayResult
from services.replay.messages import MAX_MESSAGE_BYTES, replay_request

RETRY_ON = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
PROBE_TIMEOUT_S = 2.0  # a worker that takes longer to say it is healthy counts as down


class RemoteReplay:
    def __init__(self, addresses: Sequence[str], *, timeout_s: float = 120.0,
                 breaker_cooldown_s: float = 5.0, max_message_bytes: int = MAX_MESSAGE_BYTES,
                 credentials: Credentials = Credentials()) -> None:
        if not addresses:
            raise InvalidRequest("RemoteReplay needs at least one worker address")
        options = [("grpc.max_send_message_length", max_message_bytes),
                   ("grpc.max_receive_message_length", max_message_bytes)]
        self.addresses = list(addresses)
        self._channels = [open_channel(a, credentials, options) for a in addresses]
        self._stubs = [pb_grpc.ReplayStub(c) for c in self._channels]
        self._health = [health_pb2_grpc.HealthStub(c) for c in self._channels]
        self._turn = itertools.cycle(range(len(addresses)))
        self.timeout_s = timeout_s
        self._breakers = [CircuitBreaker(f"replay:{a}", cooldown_s=breaker_cooldown_s)
                          for a in addresses]
        self.last_worker = ""

    def breakers(self) -> list[CircuitBreaker]:
        return list(self._breakers)

    async def rebuild(self, layout: str | LayoutSpec, token_ids, chunks: Sequence[Buffer],
                      tail: Buffer, replay_tokens: int | None = None, *,
                      model_fingerprint: str = "") -> ReplayResult:
        request = replay_request(layout, token_ids, chunks, tail, replay_tokens,
                                 model_fingerprint)
        return await self.send(request)

    async def send(self, request: pb.ReplayRequest) -> ReplayResult:
        started = time.perf_counter()
        failures = []
        # Workers in turn across calls; within a call, each worker once from its turn on
        # (a shared cursor would let concurrent calls try one dead worker twice).
        first = next(self._turn)
        for i in ((first + k) % len(self.addresses) for k in range(len(self.addresses))):
            breaker = self._breakers[i]
            if not breaker.allow():
                failures.append(f"{self.addresses[i]}: down (circuit open)")
                continue
            try:
                reply = await self._stubs[i].Rebuild(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in RETRY_ON:
                    breaker.failed(f"{exc.code().name}: {exc.details()}")
                    failures.append(f"{self.addresses[i]}: {exc.code().name}")
                    continue
                breaker.succeeded()  # the worker answered: its verdict on the request
                raise error_from_rpc(exc, "replay worker: ") from exc
            except asyncio.CancelledError:
                breaker.cancelled()
                raise
            breaker.succeeded()
            self.last_worker = reply.worker or self.addresses[i]
            # the caller waited for the network and the queue too: report that time
            return ReplayResult(reply.window, reply.replayed_tokens,
                                time.perf_counter() - started, reply.batch_size or 1)
        raise TierUnavailable(f"no replay worker answered: {'; '.join(failures)}")

    async def probe(self) -> bool:
        """Whether a worker says SERVING; each answer (or its absence) goes to the
        worker's breaker, which half-opens on its cool-down here as on a job."""
        answers = await asyncio.gather(*(self._probe_one(i) for i in range(len(self._stubs))))
        return any(answers)

    async def _probe_one(self, i: int) -> bool:
        breaker = self._breakers[i]
        if not breaker.allow():
            return False
        try:
            reply = await self._health[i].Check(health_pb2.HealthCheckRequest(service=""),
                                                timeout=min(PROBE_TIMEOUT_S, self.timeout_s))
        except grpc.aio.AioRpcError as exc:
            breaker.failed(f"health: {exc.code().name}")
            return False
        except asyncio.CancelledError:
            breaker.cancelled()
            raise
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            breaker.failed("health: NOT_SERVING")
            return False
        breaker.succeeded()
        return True

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()
