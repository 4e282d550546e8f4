"""The fallback stall probe, for servers without ``kvtier_event_loop_stalls_total``: a
process of its own (so the simulation's own work does not delay it) that sends a cheap
Stat every ``PERIOD_S`` until its stdin closes, then prints one JSON line: probes sent,
how many took over 50 ms, the slowest. A probe's latency bounds the server loop's
stall from above (it also counts the machine's scheduling), so this is a fallback.

    python -m bench.seams.probe TARGET [CA TOKEN]
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time

import grpc

from proto import kvtier_pb2 as pb
from proto import kvtier_pb2_grpc as pb_grpc

PERIOD_S = 0.2
SLOW_S = 0.05


def main(argv: list[str]) -> int:
    target = argv[0]
    metadata = None
    if len(argv) >= 3:
        with open(argv[1], "rb") as handle:
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(handle.read()))
        metadata = (("authorization", f"Bearer {argv[2]}"),)
    else:
        channel = grpc.insecure_channel(target)
    stub = pb_grpc.KVTierStub(channel)
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()
    probes = slow = 0
    worst = 0.0
    with contextlib.suppress(grpc.RpcError):  # the connection and TLS handshake: untimed
        stub.Stat(pb.StatRequest(), timeout=30, metadata=metadata)
    while not done.wait(PERIOD_S):
        started = time.perf_counter()
        try:
            stub.Stat(pb.StatRequest(), timeout=5, metadata=metadata)
        except grpc.RpcError:
            continue  # a probe measures latency; the simulation judges errors
        took = time.perf_counter() - started
        probes += 1
        slow += took > SLOW_S
        worst = max(worst, took)
    print(json.dumps({"probes": probes, "over_50ms": slow, "max_ms": round(worst * 1e3, 1)}),
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
