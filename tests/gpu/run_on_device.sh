#!/usr/bin/env bash
# One device call: environment facts, the GPU tests, then the benchmark (with --sweep when asked).
# Usage (repo root, CUDA machine): tests/gpu/run_on_device.sh OUT_DIR [bench args...]
set -uo pipefail
out_dir=${1:?usage: tests/gpu/run_on_device.sh OUT_DIR [bench args...]}
shift
mkdir -p "$out_dir"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out_dir/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$out_dir/env.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu 2>&1 | tee "$out_dir/pytest.log"
echo "pytest rc=${PIPESTATUS[0]}" | tee -a "$out_dir/pytest.log"
python3 tests/gpu/bench_int8_lmhead.py "$@" 2>&1 | tee "$out_dir/bench.log"
echo "bench rc=${PIPESTATUS[0]}"
