from pathlib import Path

from proto.generate import GENERATED, ROOT, generate


def test_committed_stubs_match_the_proto(tmp_path):
    for fresh in generate(tmp_path):
        committed = ROOT / "proto" / fresh.name
        assert committed.exists(), f"{committed} is missing: run `make proto`"
        assert committed.read_text() == fresh.read_text(), (
            f"{committed.name} is stale against proto/kvtier.proto: run `make proto`"
        )
    assert {Path(p).name for p in GENERATED} == {p.name for p in (tmp_path / "proto").iterdir()}


def test_every_rpc_is_in_the_service():
    from proto import kvtier_pb2

    service = kvtier_pb2.DESCRIPTOR.services_by_name["KVTier"]
    assert {m.name for m in service.methods} == {
        "Spill",
        "Restore",
        "Resume",
        "Prefetch",
        "Evict",
        "Delete",
        "Stat",
        "List",
        "LeaseSegment",
        "ReleaseSegments",
        "Lookup",
        "Fork",
        "RegisterLayout",
        "ListLayouts",
        "WriteChunks",
        "ReadChunks",
        "Drain",
        "AdoptWindow",
    }
    assert "Replay" in kvtier_pb2.DESCRIPTOR.services_by_name
