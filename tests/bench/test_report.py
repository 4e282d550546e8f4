"""bench.report renders real (tiny) benchmark results into REPORT.md and PNGs; bench.all
records the machine, names its stages and keeps going past a stage that cannot run."""

from __future__ import annotations

import json

import pytest

from bench import all as bench_all
from bench import bytes as bytes_bench
from bench import fidelity, resume
from bench.report import write_report
from bench.trace.run import run_trace_benchmark
from tests.support.replay import tiny_model

INFO = {"weights": None, "trained": False, "note": "tiny test model"}
PNG = b"\x89PNG\r\n\x1a\n"


def small_trace(path):
    """Two conversations growing a block per turn, then one coming back."""
    lines = []
    for turn in range(6):
        for conv in range(2):
            blocks = [conv * 100 + i for i in range(turn + 1)]
            lines.append({"timestamp": 1000 * (2 * turn + conv), "input_length": 512 * len(blocks),
                          "output_length": 8, "hash_ids": blocks})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


async def tiny_results(tmp_path) -> dict:
    model = tiny_model()
    stages = {
        "codec": {"error": "RuntimeError: codec did not run here", "wall_s": 0.0},
        "resume": await resume.run(model, INFO, [40], repeats=1, replay_tokens=8),
        "fidelity": await fidelity.run(model, INFO, [24], segments=1, follow=8,
                                       replays=(0, 8, 128)),
        "trace": run_trace_benchmark(small_trace(tmp_path / "t.jsonl"), fractions=[0.2, 0.5],
                                     policies=("lru", "belady"), jobs=1),
        "bytes": await bytes_bench.measure(model, INFO, [40, 23], tmp_path / "bytes"),
        "replay_batch": bench_all.child_json("replay_batch", bench_all.SIZES["tiny"][
            "replay_batch"]),
    }
    for stage in stages.values():
        stage.setdefault("wall_s", 0.1)
    return {"machine": bench_all.machine(), "sizes": "tiny", "torch_threads": 1,
            "stages": stages, "load_average_at_end": [0.5, 0.5, 0.5]}


@pytest.mark.slow  # runs every benchmark (tiny) and matplotlib: several seconds
async def test_report_has_tables_plots_machine_and_problems(tmp_path):
    results = json.loads(json.dumps(await tiny_results(tmp_path)))  # as read back from disk
    report = write_report(results, tmp_path / "out")
    text = report.read_text()
    for png in ("resume_time.png", "fidelity.png", "trace_hit_rate.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == PNG
        assert f"]({png})" in text
    for heading in ("## Headlines", "## Machine", "## Resume against re-prefill",
                    "## Replay fidelity", "## Hit rate on a request trace",
                    "## Bytes per token on disk", "## Batched replay"):
        assert heading in text
    assert "RANDOM INIT" in text  # untrained weights are never passed off as the model
    assert "codec did not run here" in text and "_tiers: not run._" in text
    machine = results["machine"]
    assert machine["torch"] in text and machine["cpu_model"] in text
    resume_rows = [line for line in text.splitlines() if line.startswith("| 40 | ")]
    # every path, the time split of the three library tier paths, the spill times
    assert len(resume_rows) == len(resume.PATHS) + 3 + 1
    assert any("not measured: random init" in line for line in resume_rows)  # disk-grpc
    # R=128 is past the 24-token context: a full replay, so the goal is met exactly
    assert "**met**" in text


def test_machine_names_the_versions():
    m = bench_all.machine()
    assert m["cpus"] >= 1 and m["memory_gib"] > 0 and m["torch"] and m["triton"]
    assert m["date_utc"].endswith("UTC")


def test_every_size_names_every_stage():
    for sizes in bench_all.SIZES.values():
        assert set(sizes) == set(bench_all.STAGES)


def test_a_missing_trace_is_recorded_and_the_run_goes_on(tmp_path):
    results = bench_all.run_all(["trace"], "tiny", tmp_path / "absent.jsonl", tmp_path / "w")
    assert "skipped" in results["stages"]["trace"]
    assert "wall_s" in results["stages"]["trace"]


def test_unknown_stage_is_refused(capsys):
    with pytest.raises(SystemExit) as refused:
        bench_all.main(["--only", "resume,nonsense"])
    assert refused.value.code == 2  # argparse's usage error, before any stage runs
    assert "unknown stages ['nonsense']; known: " in capsys.readouterr().err


def test_merge_reruns_only_the_named_stages(tmp_path, monkeypatch):
    from bench.report import separately

    monkeypatch.setattr(bench_all, "stage_runners",
                        lambda sizes, trace, weights: {"fidelity": lambda: {"rerun": True}})
    earlier = {"machine": {"git_commit": "old"}, "sizes": "quick", "torch_threads": 1,
               "load_average_at_end": [1.0, 1.0, 1.0],
               "stages": {"fidelity": {"rerun": False, "wall_s": 1.0},
                          "trace": {"kept": True, "wall_s": 2.0}}}
    out = tmp_path / "results.json"
    out.write_text(json.dumps(earlier))
    assert bench_all.main(["--only", "fidelity", "--merge", "--out", str(out),
                           "--no-report"]) == 0
    merged = json.loads(out.read_text())
    assert merged["machine"] == {"git_commit": "old"}  # the full run's record stays
    assert merged["load_average_at_end"] == [1.0, 1.0, 1.0]
    assert merged["stages"]["trace"] == {"kept": True, "wall_s": 2.0}
    fid = merged["stages"]["fidelity"]
    assert fid["rerun"] is True
    again = fid["recorded_separately"]
    assert again["git_commit"] == bench_all.machine()["git_commit"] and again["sizes"] == "quick"
    assert "rerun on its own" in "\n".join(separately(fid))
    assert separately(merged["stages"]["trace"]) == []


def test_merge_needs_earlier_results(tmp_path):
    with pytest.raises(SystemExit):
        bench_all.main(["--only", "fidelity", "--merge", "--out", str(tmp_path / "none.json")])


def test_the_int4_section_states_each_goal_met_or_not():
    from bench.report import hf_section

    variant = {"kl_nats": 2e-4, "top1_agreement": 0.99, "bytes_vs_bf16": 0.28125}
    stage = {"llama_test": {"model": "m", "held_out_stretches": 1, "context_tokens": 8,
                            "follow_tokens": 4, "int4_kl": 2e-3, "int4_top1": 0.995,
                            "int4_bytes_vs_bf16": 0.285, "variants": {"g32": variant}}}
    text = "\n".join(hf_section(stage))  # bench.hf --parts llama: no DeepseekV4 figures
    assert "2.0e-03: not met" in text and "0.9950: met" in text and "0.285x: met" in text
    assert "| g32 | 2.0e-04 | 0.9900 | 0.281x |" in text
