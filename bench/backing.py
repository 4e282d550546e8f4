"""The shared services a fleet benchmark runs against, as child processes on loopback:
one ``redis-server`` (no persistence) and moto's S3 server (``moto_server``) with one
bucket. ``env()`` is the ``KVTIER_*`` and AWS environment a ``kvtier serve`` child of
the fleet reads (docs/fleet.md; the same keys docker-compose.yml sets).

    with Backing(workdir) as backing:
        env = backing.env()  # KVTIER_REDIS_URL, KVTIER_S3_*, KVTIER_METADATA, AWS_*
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from testing.live_server import free_port

LOOPBACK = "127.0.0.1"
BUCKET = "kvtier-fleet"
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}
START_S = 30.0


def _wait(probe, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with status {proc.returncode}")
        try:
            if probe():
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer within {START_S:.0f} s")


def start_redis(workdir: Path, port: int) -> subprocess.Popen:
    """A redis-server without persistence on ``LOOPBACK:port``, once it answers PING."""
    import redis

    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", LOOPBACK, "--dir", str(workdir),
         "--save", "", "--appendonly", "no", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(host=LOOPBACK, port=port, socket_timeout=2)

    def answers() -> bool:
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        _wait(answers, "redis-server", proc)
    except BaseException:
        proc.kill()
        raise
    finally:
        client.close()
    return proc


class Backing:
    def __init__(self, workdir: Path) -> None:
        if shutil.which("redis-server") is None:
            raise RuntimeError("redis-server is not on PATH (Debian: apt-get install "
                               "redis-server)")
        self.workdir = workdir
        self.redis_port = free_port()
        self.s3_port = free_port()
        self._procs: list[subprocess.Popen] = []

    @property
    def redis_url(self) -> str:
        return f"redis://{LOOPBACK}:{self.redis_port}/0"

    @property
    def s3_endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.s3_port}"

    def __enter__(self) -> Backing:
        try:
            self._start_redis()
            self._start_s3()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _start_redis(self) -> None:
        self._procs.append(start_redis(self.workdir, self.redis_port))

    def _start_s3(self) -> None:
        import boto3

        moto = Path(sys.executable).with_name("moto_server")
        proc = subprocess.Popen([str(moto), "-H", LOOPBACK, "-p", str(self.s3_port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._procs.append(proc)
        _wait(lambda: urllib.request.urlopen(self.s3_endpoint, timeout=2).status == 200,
              "moto_server", proc)
        boto3.client("s3", endpoint_url=self.s3_endpoint,
                     aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                     region_name=CREDENTIALS["AWS_DEFAULT_REGION"]).create_bucket(Bucket=BUCKET)

    def env(self, *, redis: bool = True) -> dict[str, str]:
        """A fleet node's environment (``redis=False``: a node with the bucket only)."""
        return {**CREDENTIALS, "KVTIER_METADATA": "shared", "KVTIER_S3_ENDPOINT": self.s3_endpoint,
                "KVTIER_S3_BUCKET": BUCKET, "KVTIER_S3_REGION": CREDENTIALS["AWS_DEFAULT_REGION"],
                "KVTIER_REDIS_URL": self.redis_url if redis else ""}

    def aws(self) -> None:
        """Put the credentials in this process's environment (for a store opened here)."""
        os.environ.update(CREDENTIALS)

    def close(self) -> None:
        for proc in reversed(self._procs):
            end_process(proc)
        self._procs.clear()


def end_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM, ten seconds to exit, then SIGKILL; nothing for one already ended."""
    if proc is not None and proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
