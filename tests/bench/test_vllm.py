"""bench.vllm's summary of its engines' results (no vLLM needed: the engines' results are
made here): the user-pays keys of every case, null with a reason when a case did not run or
its engine did not start, the goals of the headline case, and the report's section."""

from __future__ import annotations

import json

import pytest

from bench.vllm import __main__ as bench_vllm
from bench.vllm.report import section

N = 1024
OUT = list(range(32))


def step(name: str, seconds: float | list[float], output=OUT, cached: int = 0, **extra
         ) -> dict:
    """A step's result; ``seconds``: one request's, or each repeat's."""
    return {"name": name, "seconds": seconds if isinstance(seconds, list) else [seconds],
            "output": output, "num_cached_tokens": [cached], **extra}


def runs(*, down_error: str | None = None, hung_capped: bool = False,
         turn3_plain=OUT) -> dict[str, dict]:
    turns = [step(f"turn{i}", 0.1) for i in (1, 2, 3)]
    # each engine's first miss pays first-use costs: slower than the misses after it
    plain = [step(f"miss{N}", [2.0, 1.0, 1.0]), step(f"prefix{N}", 0.1), step(f"P{N}", 1.0),
             step(f"Q{N}", 1.0), step("turn1", 0.1), step("turn2", 0.1),
             step("turn3", 0.1, output=turn3_plain)]
    shared = [step(f"P{N}", 1.0), step(f"Ppc{N}", 0.1), step(f"hit{N}", 0.2, cached=896),
              step(f"Phit{N}", 0.2), step(f"Q{N}", 0.2, cached=768)]
    kvtier = [step(f"cmiss{N}", 1.2), *shared, *turns,
              step(f"hung{N}", 12.2, capped=hung_capped)]
    down = ({"start_error": down_error, "steps": [], "start_s": 48.0} if down_error else
            {"start_s": 30.0, "steps": [step(f"miss{N}", [2.1, 1.1, 1.2])]})
    return {"plain": {"start_s": 30.0, "steps": plain},
            "example": {"start_s": 30.0, "steps": [*shared, *turns]},
            "kvtier": {"start_s": 30.0, "steps": kvtier, "metrics": {
                "kvtier_loads": 2.0, "kvtier_loaded_bytes": 2e8, "kvtier_load_seconds": 1.0,
                "kvtier_saved_bytes": 1e8, "kvtier_save_seconds": 1.0,
                "kvtier_saved_tokens": 2048.0}},
            "disk": {"start_s": 30.0, "steps": [step(f"dhit{N}", 0.3, cached=896),
                                                 step(f"Pdhit{N}", 0.3)]},
            "down": down}


def summary(all_runs: dict, cases=bench_vllm.CASES) -> dict:
    model = bench_vllm.summarize("tiny", bench_vllm.MODELS["tiny"], [N], all_runs,
                                 {"disk": 2048 * 2050}, memcpy=2.0, cases=cases)
    return json.loads(json.dumps({**bench_vllm.headline([model]), "models": [model]}))


def test_every_user_pays_key_is_measured_side_by_side():
    result = summary(runs())
    (case,) = result["models"][0]["cases"]
    assert case["ttft_miss_connector_s"] == 1.2
    assert case["miss_connector_vs_miss"] == pytest.approx(1.2)
    assert case["ttft_kvtier_host_hit_s"] == case["ttft_kvtier_hit_s"] == 0.2
    assert case["ttft_kvtier_disk_hit_s"] == 0.3 and case["identical"]["disk_hit"]
    assert case["hung_server_stall_s"] == pytest.approx(11.0)
    assert case["ttft_kvtier_down_s"] == 2.1 and case["not_measured"] == {}
    # a first request against a first request, not against the warm median miss
    assert case["ttft_first_miss_s"] == 2.0 and case["ttft_miss_s"] == 1.0
    assert case["down_vs_miss"] == pytest.approx(1.05)
    assert case["ttft_miss_kvtier_down_s"] == 1.2  # the median
    assert result["goal"]["down_vs_miss"]["met"] is True
    model = result["models"][0]
    assert model["memcpy_GBps"] == 2.0 and model["memcpy_bytes"] == 10**8
    assert model["load_vs_memcpy"] == pytest.approx(0.1)
    assert model["store_vs_memcpy"] == pytest.approx(0.05)
    goal = result["goal"]
    assert goal["host_hit_vs_example_hit"]["met"] is True  # 0.2 s against 0.2 s
    assert goal["hung_server_stall_s"]["met"] is False
    assert goal["load_vs_memcpy"]["met"] is False and goal["all_met"] is False


def test_an_engine_that_does_not_start_leaves_its_key_null_with_the_reason():
    result = summary(runs(down_error="RuntimeError: Engine core initialization failed "
                                     "(cause: StatusCode.UNAVAILABLE)", hung_capped=True))
    (case,) = result["models"][0]["cases"]
    assert case["ttft_kvtier_down_s"] is None and case["down_vs_miss"] is None
    assert "UNAVAILABLE" in case["not_measured"]["ttft_kvtier_down_s"]
    assert result["goal"]["down_vs_miss"]["met"] is None
    text = "\n".join(section(result))
    assert "did not start" in text and "UNAVAILABLE" in text
    assert "(capped)" in text  # the stall is a lower bound


def test_cases_not_run_at_a_size_are_null_and_say_so():
    all_runs = runs()
    del all_runs["disk"], all_runs["down"]
    all_runs["kvtier"]["steps"] = [s for s in all_runs["kvtier"]["steps"]
                                   if not s["name"].startswith("hung")]
    result = summary(all_runs, cases=("connector_miss",))
    (case,) = result["models"][0]["cases"]
    for key in ("ttft_kvtier_disk_hit_s", "hung_server_stall_s", "ttft_kvtier_down_s"):
        assert case[key] is None and "not run at this size" in case["not_measured"][key]
    text = "\n".join(section(result))
    assert "not measured" in text and "| tiny | 1024 |" in text


def test_the_session_names_where_it_first_parts_from_the_plain_engine():
    other = OUT[:7] + [999] + OUT[8:]
    session = summary(runs(turn3_plain=other))["models"][0]["session"]
    assert session["identical_outputs"]  # against the example engine, the reference
    assert session["first_divergence_from_no_connector"] == {"turn": 3, "token": 7}
    assert summary(runs())["models"][0]["session"][
        "first_divergence_from_no_connector"] is None


def test_every_engine_gets_the_same_reserved_core(monkeypatch):
    # vLLM reserves one more core for an engine with a connector: on a 2-core machine its
    # worker then gets both, computes with other threads and rounds differently
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    assert bench_vllm.engine_env()["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"


def test_the_plain_engine_still_holds_p_after_its_misses():
    # its prefix-cache hits of P follow the misses, each of which empties vLLM's cache first
    spec = bench_vllm.MODELS["tiny"]
    plan = bench_vllm.plain_plan([N], spec, repeats=3)
    misses, prefix = plan[0], plan[1]
    assert misses["reset_prefix_cache"] and len({tuple(p) for p in misses["prompts"]}) == 3
    assert misses["prompts"][-1] == prefix["prompt"] == bench_vllm.prompts(spec, N)["P"]


def test_a_failed_start_names_the_workers_error_not_vllms_wrapper():
    log = ("(EngineCore pid=1) ERROR 12-05 05:06:27 [core.py:1510] RuntimeError: Engine core "
           "initialization failed. See root cause above.\n"
           "(Worker pid=2) ERROR 12-05 05:06:27 [multiproc_executor.py:1063] \tstatus = "
           "StatusCode.UNAVAILABLE\n"
           "(EngineCore pid=1) ERROR 12-05 05:06:27 [core.py:1510] RuntimeError: Worker failed "
           "with error 'UNAVAILABLE: failed to connect to all addresses'\n")
    assert bench_vllm.cause(log) == (" (cause: RuntimeError: Worker failed with error "
                                     "'UNAVAILABLE: failed to connect to all addresses')")
    assert bench_vllm.cause("nothing to see\n") == ""


def test_the_down_engine_runs_the_plain_engines_requests_up_to_its_last_misses():
    # so each length's first miss follows the same earlier requests in both engines
    spec = bench_vllm.MODELS["tiny"]
    plain = bench_vllm.plain_plan([N, 2 * N], spec, repeats=3)
    down = bench_vllm.down_plan([N, 2 * N], spec, repeats=3)
    assert down == plain[:len(down)] and down[-1]["name"] == f"miss{2 * N}"
