"""Bounded replay: rebuild a session's sliding-window KV from its stored global KV.

``ReplayWorker`` (replay.worker) does the work; ``ReplayService`` (replay.service) is the
in-process backend of the server; ``kvtier replay-worker`` (services.replay.server) serves
it over gRPC, and services.replay.remote / services.replay.streams are the client-side
backends that call such workers directly or through Redis Streams (they live in services/
because they speak the gRPC contract; replay/ itself needs only the model and the store).
"""

from replay.service import ReplayService
from replay.worker import ReplayResult, ReplayWorker

__all__ = ["ReplayResult", "ReplayService", "ReplayWorker"]
