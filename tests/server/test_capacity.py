"""Disk capacity from the medium: a data directory on a 3 MiB filesystem with the default
64 GiB ``disk_bytes`` starts with the disk tier lowered to what the filesystem can hold (a
warning says so), and ``kvtier_disk_free_bytes`` reports the filesystem's free bytes."""

from __future__ import annotations

import asyncio
import logging
import shutil

from services.server.config import ServerConfig
from services.server.startup import DISK_SHARE
from tests.support.service import running_server

MiB = 1 << 20


async def test_a_small_filesystem_lowers_disk_bytes_with_a_warning(tmpfs_factory, caplog):
    medium = tmpfs_factory(3)
    with caplog.at_level(logging.WARNING):
        async with running_server(medium / "data", disk_bytes=ServerConfig.disk_bytes,
                                  object_bytes=0) as (server, _):
            [disk] = [tier for tier in server.manager.tiers if tier.name == "disk"]
            assert 0 < disk.capacity_bytes <= DISK_SHARE * 3 * MiB
            capacity = server.metrics.registry.get_sample_value(
                "kvtier_tier_capacity_bytes", {"tier": "disk"})
            assert capacity == disk.capacity_bytes
            free = shutil.disk_usage(medium).free
            for _ in range(100):  # the next metrics refresh (metrics_interval_s)
                gauge = server.metrics.registry.get_sample_value("kvtier_disk_free_bytes")
                if gauge:
                    break
                await asyncio.sleep(0.05)
            assert 0 < gauge <= 3 * MiB and abs(gauge - free) <= MiB
    assert "disk_bytes 68719476736 is more than the filesystem" in caplog.text


async def test_a_disk_bytes_that_fits_is_kept(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        async with running_server(tmp_path, disk_bytes=4 * MiB) as (server, _):
            [disk] = [tier for tier in server.manager.tiers if tier.name == "disk"]
            assert disk.capacity_bytes == 4 * MiB
    assert "more than the filesystem" not in caplog.text
