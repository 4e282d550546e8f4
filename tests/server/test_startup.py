"""``kvtier serve`` that cannot start says why in one line on stderr and exits 2, with no
traceback; a start that failed halfway leaves the data directory free for the next one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.format.errors import Busy, InvalidRequest
from services.server.server import create_server
from tests.support.service import config_for, running_server

ROOT = Path(__file__).resolve().parents[2]


def _kvtier(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVTIER_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "services.cli", *argv], cwd=ROOT,
                          env={**clean, **(env or {})}, capture_output=True, text=True,
                          timeout=120)


def _refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The one stderr line of a refused start; asserts it names each of ``words``."""
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("kvtier serve: ")
    for word in words:
        assert word in lines[0], (word, lines[0])
    assert result.stdout == ""
    return lines[0]


@pytest.fixture
def taken_port():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_port_in_use(tmp_path, taken_port):
    result = _kvtier("serve", "--data-dir", str(tmp_path / "d"),
                     "--listen", f"127.0.0.1:{taken_port}")
    _refused(result, f"127.0.0.1:{taken_port}", "in use", "--listen")
    assert not (tmp_path / "d").exists()  # refused before the store was opened


def test_metrics_port_in_use(tmp_path, taken_port):
    result = _kvtier("serve", "--data-dir", str(tmp_path / "d"), "--listen", "127.0.0.1:0",
                     "--metrics-port", str(taken_port))
    _refused(result, str(taken_port), "in use", "--metrics-port")


async def test_busy_data_dir(tmp_path):
    async with running_server(tmp_path):  # holds the disk tier's writer lock
        result = _kvtier("serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0")
    _refused(result, "writer lock", str(os.getpid()), str(tmp_path))


@pytest.mark.parametrize("under", ["", "sub"])
def test_data_dir_is_a_file(tmp_path, under):
    (tmp_path / "f").write_text("not a directory")
    data_dir = tmp_path / "f" / under if under else tmp_path / "f"
    result = _kvtier("serve", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0")
    _refused(result, str(data_dir), "not a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into any directory")
def test_data_dir_not_writable(tmp_path):
    locked = tmp_path / "ro"
    locked.mkdir(mode=0o555)
    result = _kvtier("serve", "--data-dir", str(locked), "--listen", "127.0.0.1:0")
    _refused(result, str(locked), "cannot be written")


@pytest.mark.parametrize("print_config", [True, False])
def test_bad_redis_url(tmp_path, print_config):
    argv = ["serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0",
            "--redis-url", "http://x"]
    _refused(_kvtier(*argv, *(["--print-config"] if print_config else [])),
             "redis_url", "redis://", "'http://x'")


@pytest.mark.parametrize(("env", "words"), [
    ({"KVTIER_S3_BUCKET": "b", "KVTIER_S3_ENDPOINT": "localhost:9000"},
     ("s3_endpoint", "http://")),
    ({"KVTIER_S3_ENDPOINT": "http://127.0.0.1:9000"}, ("s3_bucket is empty",)),
])
def test_bad_s3_settings(env, words):
    _refused(_kvtier("serve", "--print-config", env=env), *words)


def test_missing_bucket(tmp_path, s3_server, s3_credentials):
    env = {"KVTIER_S3_ENDPOINT": s3_server, "KVTIER_S3_BUCKET": "no-such-bucket",
           "AWS_ACCESS_KEY_ID": s3_credentials["aws_access_key_id"],
           "AWS_SECRET_ACCESS_KEY": s3_credentials["aws_secret_access_key"],
           "KVTIER_S3_REGION": s3_credentials["region_name"]}
    result = _kvtier("serve", "--data-dir", str(tmp_path), "--listen", "127.0.0.1:0", env=env)
    _refused(result, "'no-such-bucket'", "does not exist")


@pytest.mark.parametrize(("text", "words"), [
    ('listen = "127.0.0.1:0\n', ("cannot read config file",)),
    ("no_such_key = 1\n", ("unknown config keys", "no_such_key")),
    ('host_bytes = "lots"\n', ("not a size", "lots")),
    ('listen = "nowhere"\n', ("listen must be HOST:PORT",)),
])
def test_invalid_config_file(tmp_path, text, words):
    path = tmp_path / "kvtier.toml"
    path.write_text(text)
    _refused(_kvtier("serve", "--config", str(path)), *words)


def test_unreadable_config_file(tmp_path):
    _refused(_kvtier("serve", "--config", str(tmp_path / "missing.toml")),
             "cannot read config file", "missing.toml")


async def test_failed_start_frees_the_data_dir(tmp_path, taken_port):
    """A start refused at the gRPC bind (after the store opened) and one refused at the
    metrics port (after gRPC started) each release the writer lock and the port."""
    with pytest.raises(Busy, match="cannot listen"):
        await create_server(config_for(tmp_path, listen=f"127.0.0.1:{taken_port}"))
    with pytest.raises(Busy, match="metrics"):
        await create_server(config_for(tmp_path, metrics_port=taken_port))
    server, port = await create_server(config_for(tmp_path))
    try:
        assert port > 0 and server.manager.tiers
    finally:
        await server.stop(0.5)


async def test_busy_data_dir_in_process(tmp_path):
    async with running_server(tmp_path):
        with pytest.raises(Busy, match="another kvtier server or compaction"):
            await create_server(config_for(tmp_path))


async def test_data_dir_file_in_process(tmp_path):
    (tmp_path / "f").write_text("")
    with pytest.raises(InvalidRequest, match="not a directory"):
        await create_server(config_for(tmp_path / "f"))


async def test_a_background_task_that_swallowed_its_cancellation_still_ends():
    """As Python 3.11's wait_for can: the first cancellation is lost inside the loop's
    call, so one cancel would leave the loop running (and a stop waiting) for ever."""
    import asyncio

    from services.serving.lifecycle import end_task

    calls = 0

    async def loop_task():
        nonlocal calls
        while True:
            calls += 1
            try:
                await asyncio.sleep(0.01)
            except asyncio.CancelledError:
                if calls == 1:
                    asyncio.current_task().uncancel()
                    continue  # swallowed, as a racing wait_for does
                raise

    task = asyncio.create_task(loop_task())
    await asyncio.sleep(0)
    await asyncio.wait_for(end_task(task), 5)
    assert task.cancelled() and calls >= 2
