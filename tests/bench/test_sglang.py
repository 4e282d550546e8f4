"""bench.sglang's REPORT.md section and headline from a result of its shape."""

from __future__ import annotations

from bench.report import headlines
from bench.sglang.report import section

RESULT = {
    "pages": 64, "batch": 16, "page_bytes": 1 << 20, "layers": 8, "page_size": 32,
    "repeats": 3, "layout": "page_first", "dtype": "bf16", "kv_heads": 8, "head_dim": 128,
    "kvtier_shared_memory": True, "bytes_equal": True,
    "kvtier_set_pages_per_s": 100.0, "kvtier_set_GBps": 0.105,
    "kvtier_get_pages_per_s": 200.0, "kvtier_get_GBps": 0.21,
    "hicache_file_set_pages_per_s": 50.0, "hicache_file_set_GBps": 0.0525,
    "hicache_file_get_pages_per_s": 400.0, "hicache_file_get_GBps": 0.42,
    "get_vs_hicache_file": 0.5, "set_vs_hicache_file": 2.0, "cpus": 2,
    "load_avg": [1.0, 1.0, 1.0],
}


def test_the_section_tables_both_backends_and_their_ratios():
    text = "\n".join(section(RESULT))
    assert "| kvtier | get | 200 | 0.210 |" in text
    assert "| HiCacheFile | get | 400 | 0.420 |" in text
    assert "get 0.50x, set 2.00x" in text
    assert "1.00 MiB pages" in text


def test_the_headline_names_kvtier_beside_hicache_file():
    line = [x for x in headlines({"sglang": RESULT}) if "SGLang" in x]
    assert line and "0.50x" in line[0] and "0.21 GB/s" in line[0]
