"""The SGLang section of bench/REPORT.md, from ``bench.sglang``'s result."""

from __future__ import annotations

from stress.markdown import table


def section(stage: dict) -> list[str]:
    mib = stage["page_bytes"] / (1 << 20)
    out = ["## SGLang HiCache storage (`python -m bench.sglang`, in .venv-sglang)", "",
           f"SGLang 0.5.23's own `MHATokenToKVPoolHost` ({stage['layout']}, "
           f"{stage['dtype']}, {stage['layers']} layers of {stage['kv_heads']} KV heads of "
           f"{stage['head_dim']}, {stage['page_size']} tokens a page: {mib:.2f} MiB pages), "
           f"{stage['pages']} pages in calls of {stage['batch']}, each backend built by "
           "SGLang's `StorageBackendFactory`. kvtier: `KVTierStorage` (`dynamic`, "
           "`interface_v1`: `batch_set_v1`/`batch_get_v1` with host indices, a call's pages "
           "one kvtier call each way: independent chunks) against a live server whose host "
           "RAM tier holds every page, every page read checked end to end (the server sends "
           "only bytes of the BLAKE2b digest a page was written with; the client checks each "
           "chunk's header, section table, xxh3 payload checksum and key tokens); shared "
           f"memory: {stage['kvtier_shared_memory']}. hicache_file: SGLang's `HiCacheFile` "
           "over a temporary directory in the OS page cache, through the controller's legacy "
           "path (`get_data_page` + `batch_set`; `batch_get` + `set_from_flat_data_page`), no "
           f"checks. Best of {stage['repeats']} passes, the gets timed once kvtier's "
           "write-back to its disk tier drained; every loaded page equal to its "
           f"source: {stage['bytes_equal']}. Load average at the end: "
           f"{', '.join(f'{x:.1f}' for x in stage['load_avg'])} on {stage['cpus']} CPUs.", ""]
    configurations = [stage, *stage.get("small_pages", [])]
    rows = []
    for c in configurations:
        size = f"{c['page_size']} ({c['page_bytes'] / 1024:.0f} KiB)"
        for name, label in (("kvtier", "kvtier"), ("hicache_file", "HiCacheFile")):
            for op in ("set", "get"):
                rows.append([size, c["batch"], label, op, f"{c[f'{name}_{op}_pages_per_s']:.0f}",
                             f"{c[f'{name}_{op}_GBps']:.3f}"])
    out += table(["tokens a page", "pages a call", "backend", "op", "pages/s", "GB/s"], rows)
    out += [""] + [f"kvtier / HiCacheFile at {c['page_size']}-token pages: get "
                   f"{c['get_vs_hicache_file']:.2f}x, set {c['set_vs_hicache_file']:.2f}x."
                   for c in configurations] + [""]
    return out
