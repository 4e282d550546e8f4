"""One vLLM engine in this process, running a list of steps; the result as JSON on stdout.

``python -m bench.vllm.engine PLAN.json`` (run by ``bench.vllm``, one child per engine, so
each configuration starts from a fresh engine and none shares another's caches). A plan::

    {"model": DIR, "max_model_len": N, "prefix_caching": bool,
     "connector": null | {"kv_connector": ..., "kv_connector_module_path": ...,
                          "kv_connector_extra_config": {...}},
     "warmup": bool (default true: see below),
     "steps": [{"name": .., "prompt": [ids], "max_tokens": n, "repeat": k,
                "prompts": [[ids], ...] (instead of prompt and repeat: one per repeat),
                "reset_prefix_cache": bool, "kvtier_session": id | null,
                "fresh": bool (read no cache: a miss in this engine),
                "logprobs": k (also report each output token's top-k logprobs),
                "settle_s": seconds to wait after it (an asynchronous save lands),
                "extend": {"after": step name, "append": [ids]}   (instead of a prompt:
                          that step's prompt and answer, then ``append``: a next turn),
                "stop_server": {"pid": n, "cap_s": s} (the kvtier server SIGSTOPped
                          for the step's requests, resumed after them or after cap_s)}]}

Each step reports its wall seconds per repeat (with ``max_tokens`` 1, the time to the first
token), the greedy output token ids, and how many prompt tokens came from a cache
(``num_cached_tokens``). The connector's Prometheus counters (``vllm:kvtier_<field>``) are
reported at the end. Before its steps, an engine answers one prompt shorter than a block (a
warm-up kvtier does not look up), so no step pays the engine's first-use costs; not the
ExampleConnector's, which then matches any later prompt shorter than a block to the empty
prefix it stored and fails on it. An engine that does not start reports ``start_error``
(and no steps); a step that raises reports its ``error`` and ends the plan (the engine may
be dead).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

WARMUP_TOKENS = 16  # fewer than a block (vLLM's CPU block: 128 tokens)


def run(plan: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    transfer = None
    if plan.get("connector"):
        transfer = KVTransferConfig(kv_role="kv_both", **plan["connector"])
    started = time.perf_counter()
    try:
        llm = LLM(model=plan["model"], dtype="bfloat16", max_model_len=plan["max_model_len"],
                  enforce_eager=True, skip_tokenizer_init=True, seed=0,
                  enable_prefix_caching=plan["prefix_caching"], kv_transfer_config=transfer,
                  disable_log_stats=False)
    except Exception as exc:  # e.g. a connector that refuses to start without its server
        return {"start_s": time.perf_counter() - started, "steps": [],
                "start_error": f"{type(exc).__name__}: {exc}"}
    out = {"start_s": time.perf_counter() - started, "steps": []}
    if plan.get("warmup", True):
        # The engine's first request pays for first use (allocations, lazy setup): a prompt
        # shorter than a block, which kvtier does not look up, pays it before any step.
        llm.generate([TokensPrompt(prompt_token_ids=list(range(1, WARMUP_TOKENS + 1)))],
                     SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    done: dict[str, dict] = {}
    for step in plan["steps"]:
        try:
            out["steps"].append(run_step(llm, step, done))
        except Exception as exc:
            out["steps"].append({"name": step["name"], "error": f"{type(exc).__name__}: {exc}"})
            return out
    # A worker reports a step's transfers with the next step's output: one more short
    # request, after the last saves had time to land, flushes them into the counters.
    time.sleep(1.0)
    llm.generate([TokensPrompt(prompt_token_ids=[1, 2])],
                 SamplingParams(max_tokens=1, detokenize=False), use_tqdm=False)
    out["metrics"] = connector_metrics()
    return out


def run_step(llm, step: dict, done: dict[str, dict]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = None
    if step.get("kvtier_session"):
        extra = {"kv_transfer_params": {"kvtier_session": step["kvtier_session"]}}
    # fresh: read no cache, vLLM's own nor the connector's (a miss in this very engine)
    params = SamplingParams(max_tokens=step["max_tokens"], temperature=0.0,
                            detokenize=False, extra_args=extra,
                            skip_reading_prefix_cache=step.get("fresh") or None,
                            logprobs=step.get("logprobs"))
    if "extend" in step:  # the next turn: an earlier step's prompt, its answer, more
        before = done[step["extend"]["after"]]
        step["prompt"] = before["prompt"] + before["output"] + step["extend"]["append"]
    prompts = step.get("prompts") or [step["prompt"]] * step.get("repeat", 1)
    seconds, outputs, cached = [], [], []
    capped, refused = False, 0
    for tokens in prompts:
        if step.get("reset_prefix_cache"):
            refused += not reset_prefix_cache(llm)
        with HungServer(step.get("stop_server")) as stop:
            t = time.perf_counter()
            reply = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params,
                                 use_tqdm=False)[0]
            seconds.append(time.perf_counter() - t)
        capped = capped or stop.capped
        outputs.append(list(reply.outputs[0].token_ids))
        cached.append(reply.num_cached_tokens or 0)
    if step.get("settle_s"):
        time.sleep(step["settle_s"])
    done[step["name"]] = {"prompt": prompts[-1], "output": outputs[-1]}
    result = {"name": step["name"], "seconds": seconds, "output": outputs[-1],
              "prompt_tokens": len(prompts[-1]),
              "outputs_agree": all(o == outputs[0] for o in outputs),
              "num_cached_tokens": cached}
    if step.get("logprobs"):  # the last request's, [[token, logprob], ...] per token
        result["top_logprobs"] = [sorted([t, lp.logprob] for t, lp in top.items())
                                  for top in reply.outputs[0].logprobs]
    if refused:  # vLLM's cache kept blocks: a hit may come from it, not the connector
        result["prefix_cache_resets_refused"] = refused
    if step.get("stop_server"):
        result["capped"] = capped
    return result


def reset_prefix_cache(llm, wait_s: float = 30.0) -> bool:
    """Empty vLLM's prefix cache; vLLM refuses while a finished request's blocks wait for
    its save, so this retries for up to ``wait_s``. Whether it was emptied."""
    deadline = time.monotonic() + wait_s
    while not llm.reset_prefix_cache():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


class HungServer:
    """The kvtier server process SIGSTOPped (hung: its socket accepts, nothing answers)
    while the block runs, and resumed after it, or after ``cap_s`` seconds if the block
    still waits on it then (``capped``): a request that waits on a hung server forever is
    measured as ``cap_s`` and more, and the plan goes on."""

    def __init__(self, spec: dict | None) -> None:
        self.spec = spec
        self.capped = False
        self._timer: threading.Timer | None = None

    def __enter__(self) -> HungServer:
        if self.spec:
            os.kill(self.spec["pid"], signal.SIGSTOP)
            self._timer = threading.Timer(self.spec["cap_s"], self._resume, (True,))
            self._timer.start()
        return self

    def _resume(self, capped: bool = False) -> None:
        self.capped = self.capped or capped
        os.kill(self.spec["pid"], signal.SIGCONT)

    def __exit__(self, *exc_info) -> None:
        if self.spec:
            self._timer.cancel()
            self._resume()


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
