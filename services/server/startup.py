"""The start-up checks of ``kvtier serve`` beside the free port: a writable data directory
(owner-only), a fleet node's name, and a disk tier that fits its filesystem."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kvstore.format.errors import InvalidRequest

if TYPE_CHECKING:
    from services.server.config import ServerConfig

log = logging.getLogger(__name__)
DATA_DIR_MODE = 0o700  # sessions' KV, manifests and the audit log: the owner's only
# Of the room a disk tier may take on its filesystem (free bytes plus its own files),
# the share it is given: the LMDB metadata and segment rewrites need room besides.
DISK_SHARE = 0.9


def check_node_name(config: ServerConfig) -> None:
    """InvalidRequest when a fleet node (shared metadata) would serve under the default
    name of every node that picks its port (host:0)."""
    if config.metadata == "shared" and not config.node_id \
            and not config.listen.startswith("unix:") and config.port == 0:
        raise InvalidRequest("metadata = 'shared' with listen port 0 needs node_id: "
                             "nodes of a fleet must have distinct names")


def prepare_data_dir(path: Path, *, create: bool = True) -> None:
    """Check that files can be made in the data directory (creating it unless ``create``
    is False: then its nearest existing parent is checked), so a wrong one is refused by
    name at start-up rather than by whichever tier touches it first."""
    probe = path
    try:
        if create:
            path.mkdir(mode=DATA_DIR_MODE, parents=True, exist_ok=True)
            tighten(path)
        else:
            while not probe.exists() and probe.parent != probe:
                probe = probe.parent
            if not probe.is_dir():
                raise NotADirectoryError(str(probe))
        with tempfile.TemporaryFile(dir=probe):
            pass
    except (FileExistsError, NotADirectoryError) as exc:
        raise InvalidRequest(f"data_dir {path} is not a directory (it or a parent is a "
                             "file): choose a directory for data_dir") from exc
    except OSError as exc:
        raise InvalidRequest(f"data_dir {path} cannot be written ({exc.strerror}): fix its "
                             "permissions or choose another data_dir") from exc


def tighten(path: Path) -> None:
    """Make the data directory owner-only, with a warning when it was open to others
    (made by hand, or by an older release)."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if not mode & 0o077:
        return
    try:
        os.chmod(path, mode & ~0o077)
    except PermissionError:  # another user's directory (a mounted volume): say so only
        log.warning("data_dir %s is readable by others (mode %o) and not ours to change: "
                    "make it %o", path, mode, DATA_DIR_MODE)
        return
    log.warning("data_dir %s was readable by others (mode %o): made %o", path, mode,
                mode & ~0o077)


def held_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(FileNotFoundError):  # removed while we walk
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def fit_disk_bytes(config: ServerConfig) -> tuple[int, str]:
    """``disk_bytes``, lowered to what its filesystem can hold (``DISK_SHARE`` of the free
    bytes plus what the disk tier already holds), and the warning that says so ("" when
    it fits): a capacity the medium cannot give would be reported and planned for, then
    fail as a full disk."""
    disk_dir = config.data_dir / "disk"
    room = int(DISK_SHARE * (shutil.disk_usage(config.data_dir).free + held_bytes(disk_dir)))
    if config.disk_bytes <= room:
        return config.disk_bytes, ""
    return room, (f"disk_bytes {config.disk_bytes} is more than the filesystem of "
                  f"{config.data_dir} can hold: using {room} ({DISK_SHARE:.0%} of its free "
                  "bytes plus the disk tier's files); free space or lower disk_bytes to "
                  "silence this")
