#!/usr/bin/env bash
# One device session: GPU tests, then the decode/prefill benchmark, logs under $OUT (or ./out).
# Usage on the GPU machine, from the repository root: bench/gpu_session.sh [decode.py args...]
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
python3 -m pytest tests/e2e/test_gpu.py tests/kernels -m gpu -q -p no:cacheprovider --timeout 400 2>&1 \
  | tee "$out/gpu_tests.log" | tail -25
python3 bench/decode.py --out "$out/decode.json" "$@" 2>&1 | tee "$out/decode.log" | grep -v "^{"
