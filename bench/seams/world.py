"""The processes a simulation runs against, all real and on loopback: one redis-server
and one moto S3 server (``moto_server``) for the whole run, a development set of TLS
certificates and tokens, a small tmpfs per switch combination for the data directory,
and ``kvtier serve`` itself (``sys.executable -m services.cli serve --config FILE``),
stopped with SIGTERM or SIGKILL and started again on the same directory.

The offline tools (``kvtier compact``, ``repair``, ``migrate``) run as the CLI runs
them, with the run's environment (``PYTHONPATH`` included, so a worktree's code is the
code run)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from bench.backing import end_process
from testing.live_server import ROOT, Child, Credentials, free_port

STARTED: list[subprocess.Popen] = []  # every child of this run, for ``reap``
AWS_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1"}
CLI = [sys.executable, "-m", "services.cli"]
STALLS = "kvtier_event_loop_stalls_total"


class Redis:
    """A redis-server without persistence, on a free loopback port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.workdir), "--logfile", "redis.log",
             "--protected-mode", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        STARTED.append(self.proc)
        _wait_port(self.port, self.proc, "redis-server")

    def stop(self) -> None:
        end_process(self.proc)


class Moto:
    """moto's S3 server (``moto_server``) in a child process; buckets made on demand."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        binary = Path(sys.executable).with_name("moto_server")
        argv = [str(binary)] if binary.exists() else [sys.executable, "-m", "moto.server"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([*argv, "-H", "127.0.0.1", "-p", str(self.port)],
                                         stdout=log, stderr=log, env={**os.environ, **AWS_ENV})
        STARTED.append(self.proc)
        _wait_port(self.port, self.proc, "moto_server")

    def bucket(self, name: str) -> str:
        import boto3

        boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1",
                     aws_access_key_id="testing", aws_secret_access_key="testing"
                     ).create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        end_process(self.proc)


class Tmpfs:
    """A tmpfs of ``size_mib`` mounted at ``path`` (root needed); unmounted by ``close``.
    Without root (or mount) the directory is a plain one and ``mounted`` is False."""

    def __init__(self, path: Path, size_mib: int) -> None:
        self.path, self.size_mib = path, size_mib
        path.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs",
                               str(path)], capture_output=True) if os.geteuid() == 0 else None
        self.mounted = done is not None and done.returncode == 0

    def free(self) -> int:
        return shutil.disk_usage(self.path).free

    def close(self) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)
            self.mounted = False


class Node:
    """``kvtier serve --config FILE`` over one data directory, restartable."""

    def __init__(self, config: Path, log: Path, env: dict[str, str],
                 creds: Credentials | None) -> None:
        self.metrics_port = free_port()
        self.creds = creds
        self.child = Child([*CLI, "serve", "--config", str(config), "--log-level", "WARNING",
                            "--metrics-port", str(self.metrics_port)],
                           "kvtier serving on ", log, {**AWS_ENV, **env})
        self.refusal = ""  # what serve said when it would not start

    @property
    def target(self) -> str:
        return self.child.target

    def start(self) -> bool:
        try:
            self.child.start()
        except RuntimeError as exc:
            self.refusal = str(exc)
            return False
        STARTED.append(self.child.proc)
        return True

    def stop(self) -> int | None:
        """SIGTERM, waiting for a graceful stop; the exit status."""
        self.child.stop()
        return None if self.child.proc is None else self.child.proc.returncode

    def kill(self) -> None:
        proc = self.child.proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()

    def alive(self) -> bool:
        return self.child.alive()

    def metrics(self) -> dict[str, float]:
        """Every sample of the Prometheus endpoint, ``name{labels}`` -> value."""
        scheme, context = "http", None
        if self.creds is not None:
            scheme, context = "https", ssl.create_default_context(cafile=self.creds.ca)
        url = f"{scheme}://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=10, context=context) as reply:
            text = reply.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                try:
                    out[name] = float(value)
                except ValueError:
                    continue
        return out

    def stalls(self) -> float | None:
        """``kvtier_event_loop_stalls_total`` summed, None when the server has no such
        metric (the caller falls back to a probe)."""
        try:
            samples = self.metrics()
        except OSError:
            return None
        found = [v for k, v in samples.items() if re.match(rf"^{STALLS}(\{{|$)", k)]
        return sum(found) if found else None


def reap() -> None:
    """Kill whatever this run started that is still running (a run cut short)."""
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def cli_output(args: list[str], env: dict[str, str], timeout_s: float = 300.0
               ) -> tuple[int, str, str]:
    """A ``kvtier`` command: exit status, its stdout, the last lines of its stderr."""
    try:
        done = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s, env={**os.environ, **AWS_ENV, **env})
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout_s} s"
    return done.returncode, done.stdout, " | ".join(done.stderr.strip().splitlines()[-3:])


def run_cli(args: list[str], env: dict[str, str], timeout_s: float = 300.0
            ) -> tuple[int, dict | None, str]:
    """A ``kvtier`` command: exit status, its JSON report (None if it printed none),
    the last lines of its stderr."""
    code, stdout, tail = cli_output(args, env, timeout_s)
    report = None
    text = stdout.strip()
    if text:
        try:
            report = json.loads(text[text.index("{"):]) if "{" in text else None
        except ValueError:
            report = None
    return code, report, tail


def _wait_port(port: int, proc: subprocess.Popen, what: str) -> None:
    import socket

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not listen on {port}")
