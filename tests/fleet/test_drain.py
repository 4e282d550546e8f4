"""``kvtier drain`` on a real fleet (a ``kvtier serve`` child and an in-process node over
one moto bucket and one Redis): the drained node refuses new writes (a routed client's
go to the other node), makes every memory-acked session durable and moves its windows
to the live peer; killed with SIGKILL right after, it loses none, and the other node
resumes every session bit-exact without a replay."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from kvtier import AsyncClient, RetryPolicy, TierUnavailable
from services.cli.main import main
from testing.live_server import Child
from tests.support.fleet import SPEC, TOKENS, assert_persistent, fleet

ROOT = Path(__file__).resolve().parents[2]
SESSIONS = 6


def child_config(path: Path, shared: dict, redis_url: str, name: str, data_dir: Path) -> Path:
    values = {**shared, "redis_url": redis_url, "node_id": name, "preset": "test",
              "data_dir": str(data_dir), "listen": "127.0.0.1:0", "replay": "off"}
    path.write_text("".join(f"{key} = {json.dumps(value)}\n" for key, value in values.items()))
    return path


async def test_a_drained_node_killed_loses_no_session_and_another_resumes_them_all(
        tmp_path, fleet_env, redis_server, model_state, capsys):
    _, ids, chunks, tail, window = model_state
    config = child_config(tmp_path / "a.toml", fleet_env, redis_server, "a", tmp_path / "a")
    a = Child([sys.executable, "-m", "services.cli", "serve", "--config", str(config),
               "--log-level", "WARNING"], "kvtier serving on ", tmp_path / "a.log",
              {"PYTHONPATH": str(ROOT)})
    async with fleet(tmp_path, fleet_env, redis_server, names="b") as nodes:
        target = await asyncio.to_thread(a.start)
        try:
            async with AsyncClient(target) as on_a:
                for i in range(SESSIONS):  # memory acks: a crash before write-back loses them
                    spilled = await on_a.spill("acme", f"s{i}", SPEC, ids, chunks=chunks,
                                               tail=tail, window=window, generation=1,
                                               ack="memory")
                    assert spilled.window_kept
            assert await asyncio.to_thread(main, ["drain", "--server", target, "--json",
                                                  "--interval", "0.2"]) == 0
            out = capsys.readouterr()
            last = json.loads(out.out)
            assert last["done"] and last["phase"] == "done"
            assert last["writebackPending"] == 0 and last["writebackFailed"] == 0
            assert last["windowsMoved"] == SESSIONS and last["windowsHeld"] == 0
            assert last["windowsReleased"] == 0
            assert "kvtier drain: writeback" in out.err or "kvtier drain: writes" in out.err

            # a takes no new session: a client of a alone is told UNAVAILABLE...
            async with AsyncClient(target, timeout_s=5, retry=RetryPolicy(attempts=1)) as kv:
                with pytest.raises(TierUnavailable, match="draining"):
                    await kv.spill("acme", "late", SPEC, ids, chunks=chunks, tail=tail,
                                   generation=1)
            # ... and a routed client sends it to b, which holds its window after
            async with AsyncClient(servers=[target, nodes["b"]], timeout_s=20) as routed:
                await routed.spill("acme", "late", SPEC, ids, chunks=chunks, tail=tail,
                                   window=window, generation=1, ack="durable")
                assert (await routed.stat("acme", "late")).session.window_node_id == "b"
                for i in range(SESSIONS):  # moved: b holds every window now
                    assert (await routed.stat("acme", f"s{i}")).session.window_node_id == "b"

            assert await asyncio.to_thread(main, ["stat", "--server", nodes["b"], "--json",
                                                  "--fleet"]) == 0
            liveness = {n["nodeId"]: n for n in json.loads(capsys.readouterr().out)
                        ["fleet"]["nodes"]}
            assert liveness["a"]["state"] == "drained" and not liveness["a"]["down"]
            os.kill(a.pid, signal.SIGKILL)  # no graceful stop: nothing more is written back
        finally:
            a.stop()
        assert a.proc.returncode == -signal.SIGKILL
        async with AsyncClient(nodes["b"]) as on_b:
            for i in range(SESSIONS):
                got = await on_b.resume("acme", f"s{i}", replay_tokens=TOKENS)
                assert not got.replayed and got.replay_tokens == 0 and got.generation == 1
                assert_persistent(got, chunks, tail)
                assert bytes(got.window_blob) == window
