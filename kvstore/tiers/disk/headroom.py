"""Headroom on the medium: writes of values stop while little space is left on it.

Everything that frees space on the disk tier needs some first: a delete is a LMDB
transaction (copy-on-write pages) and logs the manifest change as a segment record,
and online reclamation copies a segment's live records before removing the file. On a
medium filled to its last byte none of that can run, so a full disk would stay full
until a restart. Puts of values are therefore refused (``TierFull``) once the medium's
free space would fall below ``reserve_bytes``; metadata commits and deletes may use
the reserve. The disk tier's own ``capacity_bytes`` is counted separately.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvstore.errors import TierFull

MiB = 1 << 20
DEFAULT_RESERVE_BYTES = 4 * MiB


def check_room(path: Path, nbytes: int, reserve_bytes: int) -> None:
    """``TierFull`` unless ``nbytes`` more leave ``reserve_bytes`` free on ``path``'s medium."""
    if reserve_bytes <= 0:
        return
    stat = os.statvfs(path)
    free = stat.f_bavail * stat.f_frsize
    if free - nbytes < reserve_bytes:
        raise TierFull(f"disk tier: the medium has {free} bytes free, and {reserve_bytes} "
                       f"stay reserved for deletes and reclamation ({nbytes} asked)")
