"""Bounded replay: rebuild a session's sliding-window KV from its stored global KV.

``ReplayWorker`` (replay.worker) does the work; ``ReplayService`` (replay.service) is the
in-process backend of the server; ``kvtier replay-worker`` (replay.worker_server) serves
it over gRPC, and replay.remote / replay.streams are the client-side backends that call
such workers directly or through Redis Streams.
"""

from replay.service import ReplayService
from replay.worker import ReplayResult, ReplayWorker

__all__ = ["ReplayResult", "ReplayService", "ReplayWorker"]
