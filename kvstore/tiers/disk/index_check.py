"""Checking the disk tier's LMDB environment before the writer opens it, and that it is
this directory's (``check_names_segments``).

Damaged LMDB pages surface as ``lmdb.CorruptedError`` or ``PageNotFoundError``, as
records that do not decode, or as an assertion in mdb.c that aborts the process, which
no ``except`` can catch. So the check runs in a child process: it verifies both meta
pages (page number, flags, magic, version, the roots within the file), opens the
environment read-only and reads every record of every database, checking the fixed
value sizes. A nonzero exit, a signal or an exception there means the environment
cannot be trusted. Costs one interpreter start (lmdb only) and one pass over the
index, which the writer's recovery makes anyway.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from kvstore.format.errors import IndexCorrupt
from kvstore.tiers.disk.fs import FileSystem
from kvstore.tiers.disk.segments import segment_files, starts_with_record

_CHILD = r"""
import struct, sys
import lmdb

path = sys.argv[1]
with open(path + "/data.mdb", "rb") as f:
    head = f.read(2 * 65536)
    size = f.seek(0, 2)
meta0 = head[16:152]
psize = struct.unpack_from("<I", meta0, 24)[0]  # mm_dbs[FREE_DBI].md_pad
if psize not in (4096, 8192, 16384, 32768, 65536):
    sys.exit(f"meta page 0 gives page size {psize}")
best = None
for number in (0, 1):
    page = head[number * psize:number * psize + 152]
    pgno, _pad, flags = struct.unpack_from("<QHH", page, 0)
    magic, version = struct.unpack_from("<II", page, 16)
    last_pg, txnid = struct.unpack_from("<QQ", page, 136)
    if pgno != number or not flags & 0x08 or magic != 0xBEEFC0DE or version != 1:
        sys.exit(f"meta page {number} is damaged")
    # The last page may lie past the end of the file: LMDB never writes a page a
    # transaction allocated and freed again. A root page is always written.
    for at in (40 + 40, 88 + 40):  # md_root of FREE_DBI and MAIN_DBI
        root = struct.unpack_from("<Q", page, at)[0]
        if root != 2**64 - 1 and root > last_pg:
            sys.exit(f"meta page {number} names root page {root} past page {last_pg}")
        if root != 2**64 - 1 and (root + 1) * psize > size:
            sys.exit(f"meta page {number} names root page {root}, past the end of the file")
sizes = {b"chunks": 32, b"metarec": 32, b"segments": 33, b"state": 8, b"meta": None}
env = lmdb.open(path, readonly=True, max_dbs=len(sizes), subdir=True)
with env.begin(buffers=True) as txn:
    names = [bytes(k) for k, _ in txn.cursor()]
    for name in names:
        if name not in sizes:
            sys.exit(f"unknown database {name!r}")
        db = env.open_db(name, txn=txn, create=False)
        for key, value in txn.cursor(db=db):
            if sizes[name] is not None and len(value) != sizes[name]:
                sys.exit(f"a {name.decode()} record of {len(value)} bytes")
"""


def problem(path: Path, *, timeout_s: float = 600.0) -> str | None:
    """Why the environment in ``path`` cannot be trusted, or None (also when it does not
    exist yet: LMDB then makes a new one)."""
    data = path / "data.mdb"
    if not data.exists() or data.stat().st_size == 0:
        return None
    try:
        done = subprocess.run([sys.executable, "-I", "-c", _CHILD, str(path)],
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"reading it took over {timeout_s:.0f} s"
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    detail = lines[-1] if lines else ""
    if done.returncode < 0:
        return f"reading it aborted with signal {-done.returncode}" + (
            f": {detail}" if detail else "")
    return detail or f"its check exited {done.returncode}"


def index_corrupt(path: Path, reason: str) -> IndexCorrupt:
    """The error naming the repair (start-up prints it to the operator, who needs the path)."""
    return IndexCorrupt(f"the disk index in {path} is corrupt ({reason}): run "
                        f"`kvtier repair --data-dir {path}`")


def check_names_segments(issued: int, fs: FileSystem, segment_dir: Path,
                         path: Path) -> None:
    """A segment file holding records under an id above ``issued`` (the highest the
    index gave out) means the index is not this directory's (lost, replaced, rolled
    back): recovery would remove every segment it does not name, so refuse and name the
    repair instead."""
    for seg_id, file in segment_files(fs, segment_dir):
        if seg_id > issued and starts_with_record(fs, file):
            raise index_corrupt(path, f"segment {seg_id} holds records but the index has "
                                f"given out segment ids up to {issued} only")
