"""``kvtier replay-worker``: the bounded-replay worker as a gRPC ``Replay`` service.

    server, port = await create_server("127.0.0.1:0", worker)   # grpc.aio, started
    ...
    await server.stop(grace)

With ``--redis-url`` the same process also takes jobs from a Redis Streams consumer
group (``services.replay.streams``), so several workers share the resumes of several servers.
It serves the bundled model (``--weights``), or with ``--hf-model`` the transformers
DeepseekV4 replayer (layouts whose replayer is ``transformers-deepseek-v4``), on the same
protocol; a request's ``layout_json`` gives the layout, so one registered only on the
kvtier server replays here too (the model still refuses a layout it cannot rebuild:
``LayoutMismatch``, which the server answers as ``ReplayUnavailable``), and a session
spilled by another model than the one it loaded (the request's ``model_fingerprint``
against the one computed from its weights, buffers and config: ``ModelMismatch``).
Errors travel as gRPC statuses with the ``kvtier-error`` trailing metadata naming the
``kvstore.format.errors`` class (``services.serving.errors.grpc_errors``, as in the kvtier
server), and bytes that are not a ``ReplayRequest`` are INVALID_ARGUMENT
(``services.serving.errors.add_servicer``).

Security takes the kvtier server's options as flags: ``--tls-cert``/``--tls-key`` (TLS),
``--tls-client-ca`` (mTLS), ``--auth-tokens-file``/``--auth-jwt-key`` (then only role
``replay`` may call Rebuild; ``services.serving.auth``), ``--audit-log``. Off loopback the
worker refuses to start without TLS and authentication unless ``--insecure`` is given.
SIGHUP reads the tokens file and the JWT key again (a file that does not parse leaves the
running ones in force, and one error line says so); SIGTERM and SIGINT stop it.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import socket
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvstore.format.errors import InvalidRequest, KVTierError
from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc
from replay.worker import DEFAULT_MAX_BATCH, DEFAULT_REPLAY_TOKENS, ReplayWorker
from services.replay.messages import MAX_MESSAGE_BYTES, Worker, decode_request
from services.serving.audit import AuditLog
from services.serving.auth import Authenticator, AuthInterceptor
from services.serving.errors import add_servicer, grpc_errors
from services.serving.lifecycle import refuse_if_taken, stop_on_signals
from services.serving.tls import INSECURE_FLAG, exposure_problem, server_credentials

log = logging.getLogger(__name__)
SERVICE = pb.DESCRIPTOR.services_by_name["Replay"].full_name
DEFAULT_LISTEN = "127.0.0.1:50052"


class ReplayServicer(pb_grpc.ReplayServicer):
    def __init__(self, worker: Worker, name: str,
                 max_message_bytes: int = MAX_MESSAGE_BYTES) -> None:
        self.worker = worker
        self.name = name
        self.max_message_bytes = max_message_bytes

    @grpc_errors  # every failure becomes a status; the worker stays up
    async def Rebuild(self, request: pb.ReplayRequest, context: grpc.aio.ServicerContext
                      ) -> pb.ReplayReply:
        layout, tokens, chunks = decode_request(request, self.max_message_bytes)
        result = await self.worker.rebuild(layout, tokens, chunks,
                                           request.tail, request.replay_tokens or None,
                                           model_fingerprint=request.model_fingerprint)
        log.debug("job %s: %d tokens replayed in %.3fs", request.job_id,
                  result.replayed_tokens, result.seconds)
        return pb.ReplayReply(window=result.window, replayed_tokens=result.replayed_tokens,
                              seconds=result.seconds, worker=self.name,
                              batch_size=result.batch_size)


async def create_server(addr: str, worker: Worker, *, name: str | None = None,
                        max_message_bytes: int = MAX_MESSAGE_BYTES,
                        credentials: grpc.ServerCredentials | None = None,
                        interceptors: tuple[grpc.aio.ServerInterceptor, ...] = ()
                        ) -> tuple[grpc.aio.Server, int]:
    """Bind ``addr`` (port 0: a free one; TLS with ``credentials``), start, and report
    SERVING; ``(server, port)``."""
    server = grpc.aio.server(options=[("grpc.max_send_message_length", max_message_bytes),
                                      ("grpc.max_receive_message_length", max_message_bytes),
                                      ("grpc.so_reuseport", 0)], interceptors=interceptors)
    try:
        port = (server.add_secure_port(addr, credentials) if credentials is not None
                else server.add_insecure_port(addr))
    except RuntimeError:  # grpcio raises where older releases returned 0
        port = 0
    if not port:
        raise InvalidRequest(f"cannot listen on {addr}")
    host = addr.rpartition(":")[0]
    name = name or f"{socket.gethostname() if host in ('0.0.0.0', '[::]') else host}:{port}"
    add_servicer(pb_grpc.add_ReplayServicer_to_server,
                 ReplayServicer(worker, name, max_message_bytes), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await server.start()
    for service in ("", SERVICE):
        await health_servicer.set(service, health_pb2.HealthCheckResponse.SERVING)
    return server, port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=DEFAULT_LISTEN,
                        help=f"host:port of the gRPC service (default {DEFAULT_LISTEN}; "
                        "port 0 picks a free one)")
    parser.add_argument("--weights", type=Path, default=None,
                        help="model weights (default: the bundled model)")
    parser.add_argument("--hf-model", default="",
                        help="serve the transformers DeepseekV4 replayer instead of the "
                        "bundled model: a save_pretrained directory, or a config JSON "
                        "whose weights are drawn at random from --hf-seed")
    parser.add_argument("--hf-seed", type=int, default=0,
                        help="seed of --hf-model's random weights (a config JSON)")
    parser.add_argument("--replay-tokens", type=int, default=DEFAULT_REPLAY_TOKENS,
                        help="R when a request names none")
    parser.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                        help="concurrent replays per model call")
    parser.add_argument("--redis-url", default=os.environ.get("KVTIER_REPLAY_REDIS_URL", ""),
                        help="also take jobs from this Redis (Streams consumer group)")
    parser.add_argument("--stream", default=None,
                        help="job stream key (Redis mode; default kvtier:replay:jobs, with "
                        "--hf-model kvtier:replay:jobs:transformers-deepseek-v4)")
    parser.add_argument("--group", default=None, help="consumer group (Redis mode)")
    parser.add_argument("--consumer", default=None,
                        help="consumer name, unique per worker (default host:pid)")
    parser.add_argument("--claim-idle-ms", type=int, default=None,
                        help="retry jobs a consumer has held this long without acking")
    parser.add_argument("--tls-cert", default="", help="serve TLS with this certificate (PEM)")
    parser.add_argument("--tls-key", default="", help="... and this private key (PEM)")
    parser.add_argument("--tls-client-ca", default="",
                        help="require client certificates signed by this CA (mTLS)")
    parser.add_argument("--auth-tokens-file", default="",
                        help="TOML tokens file (services.serving.auth); only role replay may call")
    parser.add_argument("--auth-jwt-key", default="",
                        help="check JWTs with this key (a PEM public key or secret file)")
    parser.add_argument("--auth-jwt-audience", default="", help="the JWTs' audience")
    parser.add_argument("--audit-log", default="", help="append audit events (JSON lines) here")
    parser.add_argument(INSECURE_FLAG, action="store_true",
                        help="listen off loopback without TLS and authentication")
    parser.add_argument("--log-level", default="INFO")


def security(args: argparse.Namespace) -> tuple[grpc.ServerCredentials | None,
                                                tuple[grpc.aio.ServerInterceptor, ...]]:
    """The TLS credentials and interceptors the flags ask for (InvalidRequest if they
    cannot be used)."""
    if bool(args.tls_cert) != bool(args.tls_key) or (args.tls_client_ca and not args.tls_cert):
        raise InvalidRequest("--tls-cert and --tls-key go together, and --tls-client-ca "
                             "needs both")
    credentials = (server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
                   if args.tls_cert else None)
    authenticator = Authenticator.from_settings(args.auth_tokens_file, args.auth_jwt_key,
                                                args.auth_jwt_audience)
    if authenticator is None and not args.audit_log:
        return credentials, ()
    return credentials, (AuthInterceptor(authenticator, AuditLog(args.audit_log)),)


def reload_auth(args: argparse.Namespace,
                interceptors: tuple[grpc.aio.ServerInterceptor, ...]) -> bool:
    """Read the tokens file and JWT key again into the running ``AuthInterceptor``; whether
    they were taken (authentication cannot be turned on or off without a restart)."""
    interceptor = next((item for item in interceptors if isinstance(item, AuthInterceptor)),
                       None)
    if interceptor is None or interceptor.authenticator is None:
        log.warning("reload: this replay worker authenticates nothing; nothing to reload")
        return False
    try:
        authenticator = Authenticator.from_settings(args.auth_tokens_file, args.auth_jwt_key,
                                                    args.auth_jwt_audience)
    except (OSError, ValueError, KVTierError) as exc:
        log.error("reload refused, the running tokens stay in force: %s", exc)
        return False
    interceptor.authenticator = authenticator
    log.info("reloaded: tokens")
    return True


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    problem = exposure_problem(args.listen, bool(args.tls_cert),
                               bool(args.auth_tokens_file or args.auth_jwt_key))
    if problem and not args.insecure:
        print(f"kvtier replay-worker: {problem}", file=sys.stderr)
        return 2
    try:
        guards = security(args)
        refuse_if_taken(args.listen)  # before the model loads, and without gRPC's log line
        worker = load_worker(args)
    except (FileNotFoundError, ValueError, KVTierError) as exc:
        print(f"kvtier replay-worker: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(args, worker, guards))
    except KVTierError as exc:  # start-up: the port was taken meanwhile
        print(f"kvtier replay-worker: {exc}", file=sys.stderr)
        return 2
    return 0


def load_worker(args: argparse.Namespace) -> Worker:
    """The bundled model's worker, or with ``--hf-model`` the transformers one."""
    if not args.hf_model:
        from model.checkpoint import BUNDLED_WEIGHTS, load

        return ReplayWorker(load(args.weights or BUNDLED_WEIGHTS),
                            default_tokens=args.replay_tokens, max_batch=args.max_batch)
    if args.weights:
        raise InvalidRequest("--weights are the bundled model's; --hf-model serves a "
                             "transformers model instead: give one of them")
    try:
        from replay.transformers_worker import TransformersReplayWorker, load_model
    except ImportError as exc:
        raise InvalidRequest(f"--hf-model needs transformers (pip install "
                             f"'kvtier[transformers]'): {exc}") from exc
    return TransformersReplayWorker(load_model(args.hf_model, args.hf_seed),
                                    default_tokens=args.replay_tokens)


async def _serve(args: argparse.Namespace, worker: Worker,
                 guards: tuple[grpc.ServerCredentials | None,
                               tuple[grpc.aio.ServerInterceptor, ...]]) -> None:
    credentials, interceptors = guards
    server, port = await create_server(args.listen, worker, credentials=credentials,
                                       interceptors=interceptors)
    consumer = consumer_task = None
    if args.redis_url:
        from services.replay.streams import StreamConsumer, StreamNames

        names = StreamNames.with_overrides(stream=args.stream, group=args.group,
                                           replayer=worker.replayer)
        consumer = StreamConsumer(args.redis_url, worker, names=names,
                                  consumer=args.consumer or f"{socket.gethostname()}:"
                                  f"{os.getpid()}", claim_idle_ms=args.claim_idle_ms)
        consumer_task = asyncio.create_task(consumer.run())
    stop = stop_on_signals()
    asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, reload_auth, args, interceptors)
    host = args.listen.rpartition(":")[0]
    via = f", jobs from {args.redis_url}" if args.redis_url else ""
    print(f"kvtier replay-worker serving on {host}:{port}{via}", flush=True)
    try:
        await stop.wait()
    finally:
        if consumer is not None and consumer_task is not None:
            consumer.stop()
            await consumer_task
            await consumer.close()
        await server.stop(5)
        await worker.close()
