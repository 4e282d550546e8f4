"""A real kvtier server and replay worker in child processes, driven from outside (the
stress campaigns, benchmarks and tests): started by their command lines (``kvtier serve
--preset test``, ``kvtier replay-worker``), addressed by the line each prints once it
serves, watched for death, restarted, and measured from /proc (RSS and its peak).

    with LiveServer(data_dir, log_dir) as live:
        async with channel(live.target) as ch: ...
        live.rss()                           # {"rss": bytes, "peak": bytes}

``channel()`` and ``client()`` are the one place a caller's connection is made, so
credentials are added there once: with ``Credentials`` (a development set of
``services.server.devcerts``: TLS certificates and a tokens file), the server serves
TLS and checks tokens, and callers connect through its CA with a tenant's token.
"""

from __future__ import annotations

import os
import re
import selectors
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
START_S = 120.0  # a bound on waiting for a child to serve (the worker loads a model)
MESSAGE_BYTES = 128 << 20  # above the server's own limit, so the server is what refuses


@dataclass(frozen=True)
class Credentials:
    """A development set written to ``root``: the server's certificate and tokens file,
    the CA a caller trusts, and the tokens by name (admin, acme, beta, replay)."""

    root: Path
    tokens: dict[str, str]

    @classmethod
    def write(cls, root: Path) -> Credentials:
        from services.server.devcerts import write_dev_set

        return cls(root, write_dev_set(root))

    @property
    def ca(self) -> str:
        return str(self.root / "ca.pem")

    def server_env(self) -> dict[str, str]:
        return {"KVTIER_TLS_CERT": str(self.root / "server.pem"),
                "KVTIER_TLS_KEY": str(self.root / "server-key.pem"),
                "KVTIER_AUTH_TOKENS_FILE": str(self.root / "tokens.toml")}

    @staticmethod
    def bearer(token: str) -> tuple[tuple[str, str], ...]:
        """Call metadata presenting ``token`` (any string: attacks present wrong ones)."""
        return (("authorization", f"Bearer {token}"),)


def channel(target: str, connection: int = 0, creds: Credentials | None = None
            ) -> grpc.aio.Channel:
    """A connection of its own to ``target`` (channels of one process otherwise share
    one; a connection's peer address is what the server calls a client); over TLS with
    ``creds`` (the token goes in each call's metadata: ``Credentials.bearer``)."""
    options = [("grpc.use_local_subchannel_pool", 1), ("kvtier.bench.connection", connection),
               ("grpc.max_send_message_length", MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MESSAGE_BYTES)]
    if creds is None:
        return grpc.aio.insecure_channel(target, options=options)
    ca = Path(creds.ca).read_bytes()
    return grpc.aio.secure_channel(target, grpc.ssl_channel_credentials(ca), options=options)


def client(target: str, creds: Credentials | None = None, tenant: str = "", **options):
    """The real Python client (``kvtier.AsyncClient``) to ``target``; with ``creds``,
    over TLS with ``tenant``'s token."""
    from kvtier import AsyncClient

    if creds is not None:
        options.update(tls_ca=creds.ca, token=creds.tokens[tenant])
    return AsyncClient(target, **options)


class Child:
    """A command that prints ``<prefix>HOST:PORT`` on stdout once it serves."""

    def __init__(self, argv: list[str], prefix: str, log: Path, env: dict[str, str]) -> None:
        self.argv, self.prefix, self.log, self.env = argv, prefix, log, env
        self.proc: subprocess.Popen | None = None
        self.target = ""
        self.starts = 0

    def start(self) -> str:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.argv, cwd=ROOT, stdout=subprocess.PIPE,
                                         stderr=log, env={**os.environ, **self.env})
        self.starts += 1
        selector = selectors.DefaultSelector()
        selector.register(self.proc.stdout, selectors.EVENT_READ)
        deadline, line = time.monotonic() + START_S, b""
        while not line.endswith(b"\n"):
            if not selector.select(max(0.0, deadline - time.monotonic())) \
                    or self.proc.poll() is not None:
                self.stop()
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise RuntimeError(f"{self.argv[3]} did not start: {' | '.join(tail)}")
            line += os.read(self.proc.stdout.fileno(), 4096)
        selector.close()
        text = line.decode().strip()
        if not text.startswith(self.prefix):
            self.stop()
            raise RuntimeError(f"{self.argv[3]} said {text!r}")
        self.target = text[len(self.prefix):].split(",")[0].strip()
        return self.target

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()

    def rss(self) -> dict[str, int]:
        """Current and peak resident set size in bytes, from /proc/<pid>/status."""
        out = {}
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            for field, name in (("VmRSS:", "rss"), ("VmHWM:", "peak")):
                if line.startswith(field):
                    out[name] = int(line.split()[1]) << 10
        return out

    def reset_peak(self) -> None:
        """Reset the kernel's peak RSS mark (VmHWM) to the current RSS."""
        Path(f"/proc/{self.pid}/clear_refs").write_text("5")


class LiveServer:
    """``kvtier serve --preset test`` over ``data_dir``, with a replay worker beside it
    (``replay=True``) that the server sends resumes to."""

    def __init__(self, data_dir: Path, log_dir: Path, *, replay: bool = True,
                 env: dict[str, str] | None = None, creds: Credentials | None = None
                 ) -> None:
        py = [sys.executable, "-m", "services.cli"]
        self.worker = Child([*py, "replay-worker", "--listen", "127.0.0.1:0",
                             "--log-level", "WARNING"], "kvtier replay-worker serving on ",
                            log_dir / "replay-worker.log", {}) if replay else None
        self.server_env = {**(env or {}), **(creds.server_env() if creds else {})}
        self.creds = creds
        self.metrics_port = free_port()
        self.server = Child([*py, "serve", "--preset", "test", "--data-dir", str(data_dir),
                             "--listen", "127.0.0.1:0", "--log-level", "WARNING",
                             "--metrics-port", str(self.metrics_port)],
                            "kvtier serving on ", log_dir / "server.log", self.server_env)

    def __enter__(self) -> LiveServer:
        try:
            if self.worker is not None:
                self.server_env["KVTIER_REPLAY_WORKERS"] = self.worker.start()
            self.server.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self.server.stop()
        if self.worker is not None:
            self.worker.stop()

    @property
    def target(self) -> str:
        return self.server.target

    @property
    def replay_target(self) -> str:
        return self.worker.target if self.worker is not None else ""

    def revive(self) -> int:
        """Restart whichever child died; how many did."""
        died = 0
        if self.worker is not None and not self.worker.alive():
            died += 1
            self.server_env["KVTIER_REPLAY_WORKERS"] = self.worker.start()
            self.server.stop()  # it points at the dead worker's port
        if not self.server.alive():
            died += int(self.server.proc.returncode not in (0, -signal.SIGTERM))
            self.server.start()
        return died

    def rss(self) -> dict[str, int]:
        return self.server.rss()

    def rpc_errors(self) -> Counter[str]:
        """Status code name -> RPCs the server itself ended with it, OK left out (its
        ``kvtier_requests_total``, which counts the auth interceptor's refusals too)."""
        scheme, context = "http", None
        if self.creds is not None:  # HTTPS with the gRPC port's certificate
            scheme, context = "https", ssl.create_default_context(cafile=self.creds.ca)
        with urllib.request.urlopen(f"{scheme}://127.0.0.1:{self.metrics_port}/metrics",
                                    timeout=10, context=context) as reply:
            text = reply.read().decode()
        out: Counter[str] = Counter()
        for line in text.splitlines():
            if line.startswith("kvtier_requests_total{"):
                code = re.search(r'code="([A-Z_]+)"', line).group(1)
                if code != "OK":
                    out[code] += int(float(line.rsplit(" ", 1)[1]))
        return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
