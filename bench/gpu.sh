#!/usr/bin/env bash
# The GPU checks, in one call on a lent device (../shared/GPU.md): from the repository root,
# with the device's own python3 (PYTHONPATH=. is added; a folder of carried wheels may come
# before it). Each check writes under $OUT and its exit status goes to $OUT/status.txt; a
# check that fails or is skipped does not stop the others.
#
#   bash bench/gpu.sh            # OUT defaults to ./gpu-out
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}."

check() {  # check NAME COMMAND...: stdout to NAME.out, stderr to NAME.err
    local name=$1
    shift
    echo "== $name: $*"
    "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
    echo "$name rc=$?" | tee -a "$OUT/status.txt"
}

# every Triton kernel compiled for the device against its PyTorch reference (a JSON last line)
check gpucheck python3 -m kernels.gpucheck
# DeepSeek-V4.1's bounded replay through KVTierConnector with vLLM's CUDA build: the global
# groups stored in kvtier, the window replayed by the engine, greedy outputs compared with an
# engine without kvtier ("skipped", exit 0, where vLLM's CUDA build or CUDA is missing)
check dsv41_replay python3 -m bench.vllm.dsv41_replay --out "$OUT/dsv41_replay.json"
# the HBM tier on a real device (skipped without CUDA)
check hbm_tier python3 -m pytest -q tests/tiers/test_hbm.py
