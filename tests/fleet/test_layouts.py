"""Layouts across a fleet (docs/fleet.md "Layouts"): with metadata = "shared" a layout
registered on one node is known to every node. Node a is a server in this process, node
b a `kvtier serve` child (its own layout registry, as a real second node has) over the
same moto S3 bucket: b resumes, forks and spills sessions of layouts only a registered,
lists them, and refuses a name a registered as another layout; bucket objects that are
not layouts (or not their name's) are never loaded."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from dataclasses import replace
from pathlib import Path

import boto3
import pytest
import torch

from kvstore.format.errors import InvalidRequest, UnknownLayout
from kvstore.format.layout import BaselineKV, layout_to_json
from kvstore.format.registry import get_layout
from kvtier import AsyncClient
from model.checkpoint import load, save
from model.config import BUNDLED
from model.infer import prefill
from model.net import KVTierLM
from replay.state_codec import state_to_chunks
from services.server.config_load import load_config
from services.server.server import create_server
from testing.live_server import Child

ROOT = Path(__file__).resolve().parents[2]
BUNDLED_SPEC = get_layout("kvtier-bundled")
TOKENS = 600  # one chunk of 512, a tail, and the window of 128


def engine_layout(name: str, **changes):
    """The bundled model's cache under an engine's own name: a layout id no node knows
    until it is registered."""
    return replace(BUNDLED_SPEC, name=name, replayer="bundled", **changes)


@pytest.fixture
def shared(s3_server, s3_bucket, s3_credentials, monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3_credentials["aws_access_key_id"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3_credentials["aws_secret_access_key"])
    torch.manual_seed(0)
    weights = tmp_path / "model.safetensors"
    save(KVTierLM(BUNDLED).eval(), weights)
    return {"s3_endpoint": s3_server, "s3_bucket": s3_bucket, "metadata": "shared",
            "s3_region": s3_credentials["region_name"], "replay": "in-process",
            "replay_weights": str(weights), "host_bytes": "16MiB", "listen": "127.0.0.1:0"}


@pytest.fixture
def session(shared):
    """(ids, chunks, tail, window) of one prefilled state, encoded for a given layout."""
    ids = torch.randint(0, BUNDLED.vocab, (TOKENS,), generator=torch.Generator().manual_seed(1))
    state, _ = prefill(load(Path(shared["replay_weights"])), ids, logits="none")

    def encoded(spec):
        chunks, tail, window = state_to_chunks(spec, state)
        return ids, [c for _, c in chunks], tail, window

    return encoded


@contextlib.asynccontextmanager
async def two_nodes(tmp_path: Path, shared: dict):
    config_b = tmp_path / "b.toml"
    values = {**shared, "node_id": "b", "preset": "test", "data_dir": str(tmp_path / "b")}
    config_b.write_text("".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()))
    b = Child([sys.executable, "-m", "services.cli", "serve", "--config", str(config_b),
               "--log-level", "WARNING"], "kvtier serving on ", tmp_path / "b.log",
              {"PYTHONPATH": str(ROOT)})
    server, port = await create_server(load_config(preset="test", env={}, overrides={
        **shared, "node_id": "a", "data_dir": tmp_path / "a"}))
    try:
        target_b = await asyncio.to_thread(b.start)
        async with AsyncClient(f"127.0.0.1:{port}") as on_a, AsyncClient(target_b) as on_b:
            yield on_a, on_b
    finally:
        b.stop()
        await server.stop(0.5)


def plant_objects_that_are_not_layouts(shared: dict, s3_credentials: dict, tmp_path) -> None:
    s3 = boto3.client("s3", endpoint_url=shared["s3_endpoint"], **s3_credentials)
    config = load_config(preset="test", env={}, overrides={**shared, "data_dir": tmp_path})
    root = f"{config.s3_prefix}fleet/layouts/"
    for name, body in (("engine-huge", b" " * (65 << 10)),  # more than a layout may be
                       ("engine-junk", b"{nope"),
                       # a layout, but not the one its name says
                       ("engine-named", layout_to_json(engine_layout("engine-lying")).encode())):
        s3.put_object(Bucket=shared["s3_bucket"], Key=f"{root}{name}.json", Body=body)


async def test_a_layout_registered_on_one_node_is_known_to_every_node(
        tmp_path, shared, session, s3_credentials):
    engine, forked, third, listed_only = (engine_layout(n) for n in (
        "engine-a", "engine-fork", "engine-third", "engine-listed"))
    clash = engine_layout("engine-clash")
    ids, chunks, tail, window = session(engine)
    plant_objects_that_are_not_layouts(shared, s3_credentials, tmp_path)
    async with two_nodes(tmp_path, shared) as (on_a, on_b):
        for spec in (engine, forked, third, listed_only, clash):
            assert await on_a.register_layout(spec) == spec.layout_id
        await on_a.spill("acme", "s1", engine, ids, chunks=chunks, tail=tail, window=window,
                         generation=1, ack="durable")

        # Resume on b, which never saw the layout: loaded from the bucket, and the
        # window (at home on a) rebuilt by b's replay
        resumed = await on_b.resume("acme", "s1", replay_tokens=16)
        assert resumed.replayed and resumed.layout.layout_id == engine.layout_id
        assert [bytes(c) for c in resumed.chunks] == [bytes(c) for c in chunks]
        assert bytes(resumed.tail) == bytes(tail)

        # a name a registered as another layout: refused as one node refuses it
        with pytest.raises(InvalidRequest, match="already registered in this fleet as "
                                                 "engine-clash@"):
            await on_b.register_layout(replace(clash, baseline=BaselineKV(1, 1, 1)))

        # Fork on b of a session of a layout b has not met
        f_ids, f_chunks, f_tail, _ = session(forked)
        await on_a.spill("acme", "f1", forked, f_ids, chunks=f_chunks, tail=f_tail,
                         generation=1, ack="durable")
        assert (await on_b.fork("acme", "f1", "f2", upto_tokens=512)).chunks == 1

        # Spill on b with a layout only a registered; a restores it
        t_ids, t_chunks, t_tail, _ = session(third)
        await on_b.spill("acme", "t1", third, t_ids, chunks=t_chunks, tail=t_tail,
                         generation=1, ack="durable")
        got = await on_a.restore("acme", "t1", want_window=False)
        assert [bytes(c) for c in got.chunks] == [bytes(c) for c in t_chunks]

        # ListLayouts on b lists what a registered, the one b never used too
        listed = {info.layout_id: info for info in await on_b.layouts()}
        assert listed[listed_only.layout_id].layout_json == layout_to_json(listed_only)
        assert listed[clash.layout_id].replayer == "bundled"

        # what is in the bucket but not a layout (or not its name's) is never loaded
        names = {layout_id.partition("@")[0] for layout_id in listed}
        assert not names & {"engine-huge", "engine-junk", "engine-named", "engine-lying"}
        for name in ("engine-named", "engine-huge", "engine-junk"):
            with pytest.raises(UnknownLayout):
                await on_b.lookup("acme", engine_layout(name), torch.arange(TOKENS))
