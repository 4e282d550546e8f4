"""One vLLM engine in this process, running a list of steps; the result as JSON on stdout.

``python -m bench.vllm.engine PLAN.json`` (run by ``bench.vllm``, one child per engine, so
each configuration starts from a fresh engine and none shares another's caches). A plan::

    {"model": DIR, "max_model_len": N, "prefix_caching": bool,
     "connector": null | {"kv_connector": ..., "kv_connector_module_path": ...,
                          "kv_connector_extra_config": {...}},
     "steps": [{"name": .., "prompt": [ids], "max_tokens": n, "repeat": k,
                "reset_prefix_cache": bool, "kvtier_session": id | null,
                "fresh": bool (read no cache: a miss in this engine),
                "settle_s": seconds to wait after it (an asynchronous save lands),
                "extend": {"after": step name, "append": [ids]}   (instead of a prompt:
                          that step's prompt and answer, then ``append``: a next turn)}]}

Each step reports its wall seconds per repeat (with ``max_tokens`` 1, the time to the first
token), the greedy output token ids, and how many prompt tokens came from a cache
(``num_cached_tokens``). The connector's Prometheus counters (``vllm:kvtier_<field>``) are
reported at the end.
"""

from __future__ import annotations

import json
import sys
import time


def run(plan: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if plan.get("connector"):
        transfer = KVTransferConfig(kv_role="kv_both", **plan["connector"])
    started = time.perf_counter()
    llm = LLM(model=plan["model"], dtype="bfloat16", max_model_len=plan["max_model_len"],
              enforce_eager=True, skip_tokenizer_init=True, seed=0,
              enable_prefix_caching=plan["prefix_caching"], kv_transfer_config=transfer,
              disable_log_stats=False)
    out = {"start_s": time.perf_counter() - started, "steps": []}
    done: dict[str, dict] = {}
    for step in plan["steps"]:
        extra = None
        if step.get("kvtier_session"):
            extra = {"kv_transfer_params": {"kvtier_session": step["kvtier_session"]}}
        # fresh: read no cache, vLLM's own nor the connector's (a miss in this very engine)
        params = SamplingParams(max_tokens=step["max_tokens"], temperature=0.0,
                                detokenize=False, extra_args=extra,
                                skip_reading_prefix_cache=step.get("fresh") or None)
        if "extend" in step:  # the next turn: an earlier step's prompt, its answer, more
            before = done[step["extend"]["after"]]
            step["prompt"] = before["prompt"] + before["output"] + step["extend"]["append"]
        seconds, outputs, cached = [], [], []
        for _ in range(step.get("repeat", 1)):
            if step.get("reset_prefix_cache"):
                llm.reset_prefix_cache()
            t = time.perf_counter()
            reply = llm.generate([TokensPrompt(prompt_token_ids=step["prompt"])], params,
                                 use_tqdm=False)[0]
            seconds.append(time.perf_counter() - t)
            outputs.append(list(reply.outputs[0].token_ids))
            cached.append(reply.num_cached_tokens or 0)
        if step.get("settle_s"):
            time.sleep(step["settle_s"])
        done[step["name"]] = {"prompt": step["prompt"], "output": outputs[-1]}
        out["steps"].append({"name": step["name"], "seconds": seconds, "output": outputs[-1],
                             "prompt_tokens": len(step["prompt"]),
                             "outputs_agree": all(o == outputs[0] for o in outputs),
                             "num_cached_tokens": cached})
    # A worker reports a step's transfers with the next step's output: one more short
    # request, after the last saves had time to land, flushes them into the counters.
    time.sleep(1.0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2])],
                 SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    out["metrics"] = connector_metrics()
    return out


def connector_metrics() -> dict[str, float]:
    """The connector's counters (``vllm:kvtier_<field>``) in this process's Prometheus
    registry, where vLLM's stats logger records them, summed over labels:
    ``kvtier_<field>`` -> value. Read from the registry, not ``LLM.get_metrics()``, which
    truncates counters to integers (the seconds fields)."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for family in REGISTRY.collect():
        for sample in family.samples:
            # counters end in _total; a latency histogram's seconds are its _sum
            if sample.name.startswith("vllm:kvtier_") \
                    and sample.name.endswith(("_total", "_seconds_sum")):
                name = sample.name.removeprefix("vllm:").removesuffix("_total") \
                    .removesuffix("_sum")
                totals[name] = totals.get(name, 0.0) + float(sample.value)
    return totals


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = run(json.load(f))
    sys.stdout.write("BENCH-RESULT " + json.dumps(result) + "\n")
