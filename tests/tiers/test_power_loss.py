"""Simulated power loss at every point of a disk-tier workload (testing.simfs
and power_loss): every durable ack survives, nothing restores wrong, recovery never
fails. Real files and a real TierManager; only the crash is simulated."""

from __future__ import annotations

import os

import pytest

from kvstore.tiers.disk import log as segment_log
from kvstore.tiers.disk import pipeline
from testing.power_loss import (
    Compact,
    Delete,
    Spill,
    large_workload,
    run_crash_campaign,
    small_workload,
)
from testing.simfs import SECTOR, RecordingFileSystem, power_loss_images


def assert_clean(report: dict) -> None:
    assert report["failures"] == []
    assert report["acked_lost"] == 0
    assert report["wrong"] == 0
    assert report["recovery_failures"] == 0


def test_every_crash_point_of_a_small_workload():
    workload = small_workload()
    assert {type(step) for step in workload} == {Spill, Delete, Compact}
    report = run_crash_campaign(workload, seed=0)
    assert_clean(report)
    assert report["crash_points"] == report["events"] + 1
    assert report["images"] >= report["crash_points"] // 2  # most points differ
    assert report["acked_durable"] > report["images"] // 2


def test_the_campaign_catches_a_missing_segment_fsync(monkeypatch):
    monkeypatch.setattr(pipeline.CommitPipeline, "_fsync", lambda self, seg_ids: None)
    report = run_crash_campaign(small_workload(), seed=0)
    assert report["acked_lost"] > 0


def test_the_campaign_catches_a_missing_directory_fsync(monkeypatch):
    monkeypatch.setattr(RecordingFileSystem, "fsync_dir", lambda self, directory: None)
    report = run_crash_campaign(small_workload(), seed=0)
    assert report["acked_lost"] > 0


def test_the_campaign_catches_a_missing_seal_fsync(monkeypatch):
    async def no_sync(self):
        return None

    monkeypatch.setattr(segment_log.SegmentAppender, "sync", no_sync)
    report = run_crash_campaign(small_workload(), seed=0)
    assert report["acked_lost"] > 0


def test_images_drop_tear_and_keep_unsynced_state(tmp_path):
    root = tmp_path / "root"
    (root / "d").mkdir(parents=True)
    fs = RecordingFileSystem(root, tmp_path / "snapshots")
    fd = fs.open(root / "d" / "f", os.O_WRONLY | os.O_CREAT)
    fs.write(fd, [b"a" * SECTOR], 0)
    fs.fsync(fd)
    fs.fsync_dir(root / "d")
    fs.write(fd, [b"b" * (4 * SECTOR)], SECTOR)  # never synced
    other = fs.open(root / "d" / "g", os.O_WRONLY | os.O_CREAT)
    fs.write(other, [b"g"], 0)
    fs.fsync(other)  # synced, but its directory entry never was
    fs.close(fd)
    fs.close(other)
    seen = {}
    for image in power_loss_images(fs.log, tmp_path / "work", seed=1, points=[len(fs.log)]):
        f = (image.path / "d" / "f").read_bytes()
        seen[image.variant] = (f, (image.path / "d" / "g").exists())
    assert seen["page-cache"] == (b"a" * SECTOR + b"b" * (4 * SECTOR), True)
    assert seen["synced-only"] == (b"a" * SECTOR, False)
    torn, _ = seen["torn-last"]
    assert torn[:SECTOR] == b"a" * SECTOR
    assert 0 < torn.count(b"b") < 4 * SECTOR  # some sectors of the write, not all
    assert torn.count(b"b") % SECTOR == 0


@pytest.mark.slow
def test_every_crash_point_of_a_larger_workload():
    report = run_crash_campaign(large_workload(sessions=8, rounds=5, seed=1), seed=1)
    assert_clean(report)
    assert report["acked_durable"] > 100
