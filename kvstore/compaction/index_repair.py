"""Repairing a data directory's disk index: the rebuild from its segment files
(``kvstore.tiers.disk.rebuild``) with the reference counts recounted from the manifests.

On an encrypted data directory the manifests are encrypted (``kvstore.encryption.tiers``):
the references are recounted from them opened with the server's keyring. Without the
keys they name, or with a key of their id that does not open them, the repair refuses
before changing anything (every chunk would look unreferenced, and compaction would
collect them).

Chunks no manifest names are kept and reported as orphans: compaction collects them.
A session whose chunks are not all on disk is reported as incomplete, with the chunks
the disk lacks (they may live in another tier); ``RepairReport.settle`` then names the
sessions lost: a chunk held neither on disk nor by the tiers that were listed, or a
manifest that does not decode. What the log names and the rebuild cannot give back is
data loss, never a clean repair.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from kvstore.encryption.census import Census
from kvstore.encryption.seal import Keyring
from kvstore.encryption.tiers import opened_record
from kvstore.format.errors import ChunkCorrupt, InvalidRequest, UnsupportedVersion
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest
from kvstore.tiers.base import FLEET_BUCKET_KEY, REF_PREFIX
from kvstore.tiers.disk.fs import OS, FileSystem
from kvstore.tiers.disk.rebuild import Rebuild, rebuild_index


@dataclass
class RepairReport(Rebuild):
    """The index rebuild's figures, and what the recount of the manifests found."""

    sessions: list[str] = field(default_factory=list)  # tenant/session recovered
    incomplete: list[str] = field(default_factory=list)  # with chunks not on disk
    orphans: list[str] = field(default_factory=list)  # chunk keys no manifest names
    corrupt_manifests: list[str] = field(default_factory=list)
    # incomplete sessions' chunks not on disk, by session
    not_on_disk: dict[str, list[str]] = field(default_factory=dict)
    # settle's: "tenant/session: key" for each chunk held nowhere, "name (manifest)" for each
    # manifest that does not decode
    lost: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def settle(self, held_elsewhere: set[str]) -> list[str]:
        """Name what the log holds that the repair did not give back: each chunk of an
        incomplete session that no other tier holds (``held_elsewhere``: the keys those
        the caller could list hold), and each corrupt manifest. Sets and returns
        ``lost``."""
        self.lost = [f"{session}: {key}" for session, keys in self.not_on_disk.items()
                     for key in keys if key not in held_elsewhere]
        self.lost += [f"{name} (manifest)" for name in self.corrupt_manifests]
        return self.lost


def repair(path: str | Path, *, keyring: Keyring | None = None,
           fleet_manifests: Mapping[str, bytes] | None = None, map_size: int = 64 << 30,
           fs: FileSystem = OS) -> RepairReport:
    """Rebuild the index of the disk tier in ``path`` (the directory holding
    ``segments/`` and ``index/``). Raises ``Busy`` while a writer or compaction holds it,
    ``InvalidRequest`` (changing nothing) when manifests are encrypted under keys
    ``keyring`` (the server's, for an encrypted directory) does not hold or open.
    ``fleet_manifests``: a fleet node's manifests (metadata = "shared"), opened, as the
    bucket holds them: its log holds none, so its references are counted from these
    (every node's: a chunk another node's session names is kept too, never freed)."""
    started = time.perf_counter()
    path = Path(path)
    report = RepairReport(str(path))

    def recount(logged: dict[bytes, bytes], on_disk: set[str]) -> dict[bytes, bytes]:
        _check_keys(path, logged, keyring)
        bucket = logged.get(FLEET_BUCKET_KEY.encode())
        if bucket is not None and fleet_manifests is None:
            raise InvalidRequest(f"{path} is a fleet node's: its manifests live in "
                                 f"{bucket.decode(errors='replace')}; give the node's config "
                                 "(metadata = 'shared') so its references are counted from "
                                 "them; nothing was changed")
        manifests = dict(logged)
        manifests.update((key.encode(), raw) for key, raw in (fleet_manifests or {}).items())
        refs = _sessions(manifests, on_disk, report, keyring)
        return {f"{REF_PREFIX}{key}".encode(): str(count).encode()
                for key, count in refs.items()}

    rebuilt = rebuild_index(path, derive=recount, map_size=map_size, fs=fs)
    for name in (f.name for f in fields(Rebuild)):
        setattr(report, name, getattr(rebuilt, name))
    report.seconds = time.perf_counter() - started
    return report


def _check_keys(path: Path, logged: dict[bytes, bytes], keyring: Keyring | None) -> None:
    """Refuse a repair whose encrypted manifests ``keyring`` does not open (missing, or a
    wrong key of the right id): their references would go uncounted."""
    census = Census(f"the disk tier in {path}")
    for key, payload in logged.items():
        name = key.decode(errors="replace")
        if name.startswith(MANIFEST_PREFIX):
            census.note(name, payload)
    census.require(keyring, clear_allowed=True)  # a key on a clear directory does no harm


def _sessions(logged: dict[bytes, bytes], on_disk: set[str], report: RepairReport,
              keyring: Keyring | None) -> Counter[str]:
    """Reference counts recounted from the manifests, and the report's session lists."""
    refs: Counter[str] = Counter()
    for key, raw in sorted(logged.items()):
        name = key.decode(errors="replace")
        if not name.startswith(MANIFEST_PREFIX):
            continue
        try:
            manifest = SessionManifest.decode(opened_record(name, raw, keyring))
        except (ChunkCorrupt, UnsupportedVersion):
            report.corrupt_manifests.append(name[len(MANIFEST_PREFIX):])
            continue
        refs.update(manifest.chunk_keys)  # as the ledger counts: one per key named
        session = f"{manifest.tenant}/{manifest.session_id}"
        missing = [chunk for chunk in manifest.chunk_keys if chunk not in on_disk]
        (report.incomplete if missing else report.sessions).append(session)
        if missing:
            report.not_on_disk[session] = missing
    report.orphans = sorted(on_disk - set(refs))
    return refs
