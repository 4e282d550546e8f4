"""The check a disk tier's LMDB index passes before the writer opens it
(``kvstore.tiers.disk.index_check``): it must pass every environment LMDB itself commits,
and still catch one that lost its pages."""

from __future__ import annotations

import random
import struct

import lmdb

from kvstore.tiers.disk.index_check import problem


def metas_past_the_end(path) -> bool:
    """Whether a meta page names a last page past the end of data.mdb."""
    with open(path / "data.mdb", "rb") as f:
        head = f.read(2 * 65536)
        size = f.seek(0, 2)
    psize = struct.unpack_from("<I", head, 16 + 24)[0]
    last = [struct.unpack_from("<Q", head, n * psize + 136)[0] for n in (0, 1)]
    return any((pg + 1) * psize > size for pg in last)


def committed_with_a_last_page_never_written(path) -> None:
    """Transactions that put and delete records until a commit leaves the meta's last page
    past the end of the file: pages a transaction allocated and freed again are never
    written (seeded: a few dozen transactions)."""
    env = lmdb.open(str(path), map_size=1 << 26, max_dbs=5, sync=True, metasync=True,
                    writemap=False)
    db = env.open_db(b"meta")
    rng = random.Random(1)
    live: list[bytes] = []
    try:
        for _ in range(3000):
            with env.begin(write=True, db=db) as txn:
                new = [rng.randbytes(rng.choice([8, 32])) for _ in range(rng.randrange(1, 200))]
                for key in new:
                    txn.put(key, rng.randbytes(rng.choice([8, 33, 200, 2500])))
                for key in new[:rng.randrange(0, len(new) + 1)]:
                    txn.delete(key)
                for _ in range(rng.randrange(0, 50)):
                    if live:
                        txn.delete(live.pop(rng.randrange(len(live))))
                live += new[len(new) // 2:]
            if metas_past_the_end(path):
                return
    finally:
        env.close()
    raise AssertionError("no commit left its last page unwritten")


def test_an_index_whose_last_page_lmdb_never_wrote_is_trusted(tmp_path):
    committed_with_a_last_page_never_written(tmp_path)
    assert problem(tmp_path) is None
    env = lmdb.open(str(tmp_path), readonly=True, max_dbs=5)  # LMDB reads it too
    with env.begin(db=env.open_db(b"meta", create=False)) as txn:
        assert sum(1 for _ in txn.cursor()) > 0
    env.close()


def test_an_index_cut_short_is_not_trusted(tmp_path):
    committed_with_a_last_page_never_written(tmp_path)
    data = tmp_path / "data.mdb"
    with open(data, "r+b") as f:
        f.truncate(f.seek(0, 2) // 2)
    assert problem(tmp_path) is not None
