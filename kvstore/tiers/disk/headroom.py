"""Headroom on the medium: every write that stores something leaves a reserve free on it.

Everything that frees space on the disk tier needs some first: a delete is an LMDB
transaction (copy-on-write pages), a manifest's deletion is logged as a tombstone
record, and online reclamation copies a segment's live records before removing the
file. On a medium filled to its last byte none of that can run, and a full disk would
stay full. So every write that stores something (a value put, a metadata put such as a
manifest or a note, a compaction's copies) is refused (``TierFull``) when what it may
take would leave less than ``reserve_bytes`` free: its segment records and the index
pages its transaction may add, counted whole (an overwrite appends a new record too).
Only what frees space uses the reserve: value deletes, metadata commits that delete
(tombstones, and the reference counts and retention marks that go with them), and a
segment rewrite, which frees more than it writes and may take half of the reserve, so
deletes always find the other half. The disk tier's own ``capacity_bytes`` is counted
separately. The object tier in a local directory (``data_dir/objects``, the same medium)
leaves the reserve as well: a chunk that a full medium sheds from the disk tier moves
down there, and would otherwise take the very space its delete was to give back.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.format.errors import TierFull

if TYPE_CHECKING:
    from kvstore.tiers.disk.index import SegmentInfo

MiB = 1 << 20
DEFAULT_RESERVE_BYTES = 4 * MiB
PAGE_BYTES = 4096  # LMDB's page (the OS page on the platforms kvtier runs on)
# Pages a transaction may add to the index file besides one leaf per key written: the
# branch pages above the leaves are copied on write (depth 4 holds far more keys than a
# tier has).
BRANCH_PAGES = 4


def index_growth(keys: int, stored_bytes: int = 0) -> int:
    """The most an LMDB transaction writing ``keys`` keys, whose values hold
    ``stored_bytes`` in the index itself, may add to the index file."""
    return (keys + BRANCH_PAGES) * PAGE_BYTES + stored_bytes


def rewrite_need(infos: Iterable[SegmentInfo]) -> int:
    """What rewriting these segments may take before it frees them: their live records
    copied, and the switch transaction's index pages."""
    infos = list(infos)
    return (sum(info.live_bytes for info in infos)
            + index_growth(sum(info.live_records for info in infos)))


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still use on ``path``'s medium."""
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def medium_full(path: Path, reserve_bytes: int) -> bool:
    """Whether ``path``'s medium is within one reserve of refusing writes (less than twice
    ``reserve_bytes`` free): cache kept there should give the space back."""
    return reserve_bytes > 0 and free_bytes(path) < 2 * reserve_bytes


def check_room(path: Path, nbytes: int, reserve_bytes: int, who: str = "disk tier") -> None:
    """``TierFull`` unless ``nbytes`` more leave ``reserve_bytes`` free on ``path``'s medium
    (nothing asked is always granted: that is what deletes ask); ``who`` writes."""
    if reserve_bytes <= 0 or nbytes <= 0:
        return
    free = free_bytes(path)
    if free - nbytes < reserve_bytes:
        raise TierFull(f"{who}: the medium has {free} bytes free, and {reserve_bytes} "
                       f"stay reserved for deletes and reclamation ({nbytes} asked)")
