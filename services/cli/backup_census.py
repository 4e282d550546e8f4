"""A backup's census: what its source held when it was taken, and a restore's check
against it.

``kvtier backup`` writes the census into ``backup.json`` (``census``): every session
(tenant, id, generation and chunk count where the manifest is in clear, and the BLAKE2b
of its stored manifest record, sealed or not), the number of chunks with a digest of
their keys, and for a data directory the segment files copied. ``kvtier restore-backup``
checks the restored store against it: a session, chunk or segment the census names that
the restore does not hold, or holds differently, is data loss. The file digests alone
cannot say so: a segment dropped from the folder and from the file list alike leaves a
backup whose every listed file is intact, and recovery on open forgets the records that
lived in it, so the restored store looks merely smaller.
"""

from __future__ import annotations

import hashlib

from kvstore.encryption.seal import MAGIC as SEALED_MAGIC
from kvstore.format.errors import ChunkCorrupt, DataLoss, InvalidRequest, UnsupportedVersion
from kvstore.session.manifest import MANIFEST_PREFIX, SessionManifest


def _record(stored: bytes) -> str:
    return hashlib.blake2b(stored, digest_size=32).hexdigest()


def session_line(name: str, stored: bytes) -> dict:
    """The census line of the manifest record ``name`` ("manifest/TENANT/SESSION")
    holding ``stored``; ``DataLoss`` when a clear one does not decode (a sealed one is
    opened only by a restore, with the key)."""
    tenant, _, session = name[len(MANIFEST_PREFIX):].partition("/")
    line: dict[str, object] = {"tenant": tenant, "session": session, "generation": None,
                               "chunks": None,
            "record": _record(stored)}
    if not stored.startswith(SEALED_MAGIC):
        try:
            manifest = SessionManifest.decode(stored)
        except (ChunkCorrupt, UnsupportedVersion) as exc:
            raise DataLoss(f"the source's manifest {name} does not decode: {exc}") from exc
        line |= {"generation": manifest.generation, "chunks": len(manifest.chunk_keys)}
    return line


def take(manifests: list[tuple[str, bytes]], chunks: int, chunk_keys: str,
         segments: list[str] | None = None) -> dict:
    """The census of a source holding ``manifests`` ((key, stored value) each),
    ``chunks`` chunks whose keys digest to ``chunk_keys`` and, for a data directory,
    the backup paths of its ``segments``."""
    census = {"sessions": [session_line(name, stored) for name, stored in manifests],
              "chunks": chunks, "chunk_keys": chunk_keys}
    return census | ({} if segments is None else {"segments": segments})


def read(manifest: dict) -> dict | None:
    """``backup.json``'s census, checked for shape; None in a version 1 backup."""
    if manifest.get("version") == 1:
        return None
    census = manifest.get("census")
    try:
        ok = (isinstance(census, dict) and isinstance(census["sessions"], list)
              and isinstance(census["chunks"], int)
              and isinstance(census["chunk_keys"], str)
              and all(isinstance(line[field], str) for line in census["sessions"]
                      for field in ("tenant", "session", "record"))
              and all(isinstance(path, str) for path in census.get("segments", [])))
    except (TypeError, KeyError):
        ok = False
    if not ok:
        raise InvalidRequest("backup.json holds no readable census (sessions, chunks, "
                             "chunk_keys): it is not a version 2 kvtier backup")
    assert isinstance(census, dict)  # ok says so
    return census


def _named(line: dict) -> str:
    said = [f"generation {line['generation']}"] if line.get("generation") is not None else []
    said += [f"{line['chunks']} chunks"] if line.get("chunks") is not None else []
    return f"{line['tenant']}/{line['session']}" + (f" ({', '.join(said)})" if said else "")


def unlisted_segments(census: dict, listed: set[str]) -> list[str]:
    """The census's segments that ``backup.json`` does not list among its files."""
    return [f"segment {path}: in the backup's census, not among its files"
            for path in census.get("segments", []) if path not in listed]


def compare(census: dict, sessions: dict[str, bytes], chunks: int, chunk_keys: str
            ) -> tuple[list[str], list[str]]:
    """(missing, differing) of a restore holding ``sessions`` (manifest key -> stored
    value) and ``chunks`` chunks whose keys digest to ``chunk_keys``, against the census."""
    missing, differing = [], []
    named = set()
    for line in census["sessions"]:
        name = f"{MANIFEST_PREFIX}{line['tenant']}/{line['session']}"
        named.add(name)
        if name not in sessions:
            missing.append(f"{_named(line)}: in the backup's census, not restored")
        elif _record(sessions[name]) != line["record"]:
            differing.append(f"{_named(line)} (manifest): differs from the backup's census")
    differing += [f"{name[len(MANIFEST_PREFIX):]} (manifest): restored, not in the backup's "
                  "census" for name in sorted(set(sessions) - named)]
    if chunks != census["chunks"] or chunk_keys != census["chunk_keys"]:
        missing.append(f"chunks: {chunks} restored, the backup's census has "
                       f"{census['chunks']} (their keys "
                       f"{'agree' if chunk_keys == census['chunk_keys'] else 'differ'})")
    return missing, differing
