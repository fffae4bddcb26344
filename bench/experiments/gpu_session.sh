#!/usr/bin/env bash
# One device session, in stages, logs under $OUT (or ./out). Run on the GPU machine from the repository root:
#   bench/experiments/gpu_session.sh tests kernels breakdown structured     # ~4 min
#   bench/experiments/gpu_session.sh decode                                 # ~5 min: bench/decode.py, both shapes, HF in the same run
# Stages: tests (GPU tests), kernels (bench/kernel_bench.py), breakdown (bench/experiments/step_breakdown.py with --timeline, SmolLM2 batch 1 and
# Llama-3-8B shape with 8 layers), structured (bench/structured.py on random SmolLM2 weights; needs the real
# tokenizer files in $TOKENIZER_DIR, default .bench-tokenizer), structured-profile (the same at batch 1 with the
# engine steps' host profile, into structured_profile.log), sweep (SmolLM2 batch 1 step time under tuning variants:
# bench/experiments/step_breakdown.py --kernel-config/--skip-pass), gemv-sweep (bench/experiments/gemv_sweep.py: the decode GEMV against cuBLAS at
# Llama-3-8B shapes under tiling variants), gemv-policy (Llama-3-8B step under each one-row GEMV weight bound),
# prefill (bench/experiments/prefill_breakdown.py: host and GPU time of a prefill, graphs and eager), decode (bench/decode.py; extra arguments in $DECODE_ARGS, e.g. "--batches 1 --kernel-config NAME=VALUE").
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv > "$out/gpu.txt"
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case "$stage" in
    tests) python3 -m pytest tests/e2e/test_gpu.py tests/kernels -m gpu -q -p no:cacheprovider --timeout 400 2>&1 \
             | tee "$out/gpu_tests.log" | tail -25 ;;
    kernels) python3 bench/kernel_bench.py 2>&1 | tee "$out/kernels.log" | grep -v Warning ;;
    breakdown) for args in "--shape smollm2-135m --batch 1 --timeline" "--shape smollm2-135m --batch 64 --top 8" \
                           "--shape llama3-8b --layers 8 --batch 1 --top 8 --timeline"; do
                 python3 bench/experiments/step_breakdown.py $args 2>&1 | grep -v Warning
                 # The same without programmatic dependent launch, to measure what it gives.
                 python3 bench/experiments/step_breakdown.py ${args/ --timeline/} --top 0 --kernel-config pdl=false 2>&1 \
                   | grep -v Warning | head -1
               done | tee "$out/breakdown.log" ;;
    sweep) for variant in "" "--skip-pass fuse_rope_attention" "--kernel-config decode_min_split_tokens=64" \
                          "--kernel-config decode_min_split_tokens=32" "--kernel-config decode_min_split_tokens=4096" \
                          "--kernel-config gemv_programs_per_sm=4" "--kernel-config gemv_num_warps=2" ""; do
             python3 bench/experiments/step_breakdown.py --shape smollm2-135m --batch 1 --top 0 $variant 2>&1 | grep "engine step"
           done | tee "$out/sweep.log" ;;
    gemv-sweep) python3 bench/experiments/gemv_sweep.py --tokens 1 --variant "" --variant "gemv_num_warps=8" \
                  --variant "gemv_block_n=(4,4) gemv_block_k=(64,2048)" --variant "gemv_product_elements=8192" 2>&1 \
                  | tee "$out/gemv_sweep.log" | grep "|"
                python3 bench/experiments/gemv_sweep.py --tokens 8 --variant "" 2>&1 | tee -a "$out/gemv_sweep.log" | grep "|" ;;
    gemv-policy) # Llama-3-8B (8 layers) batch-1 step under each one-row GEMV weight bound: 16 MiB (cuBLAS for all
                 # of Llama's GEMMs), 128 MiB (GEMV for qkv, o and down), unbounded (also gate/up and lm_head).
                 for bound in 16777216 134217728 4611686018427387904; do
                   python3 bench/experiments/step_breakdown.py --shape llama3-8b --layers 8 --batch 1 --top 4 \
                     --kernel-config gemv_one_row_max_weight_bytes=$bound 2>&1 | grep -v Warning
                 done | tee "$out/gemv_policy.log" ;;
    prefill) for args in "--shape smollm2-135m --batch 1" "--shape smollm2-135m --batch 1 --eager --top 0" \
                         "--shape smollm2-135m --batch 8 --top 8" "--shape smollm2-135m --batch 8 --eager --top 0" \
                         "--shape llama3-8b --layers 8 --batch 1 --top 8" \
                         "--shape llama3-8b --layers 8 --batch 1 --eager --top 0"; do
               python3 bench/experiments/prefill_breakdown.py $args 2>&1 | grep -v Warning
             done | tee "$out/prefill.log" ;;
    structured) python3 bench/structured.py --random-shape smollm2-135m --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" \
                  --batches 1 16 64 2>&1 | tee "$out/structured.log" | tail -7 ;;
    structured-profile) python3 bench/structured.py --random-shape smollm2-135m \
                  --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" --batches 1 --profile > "$out/structured_profile.log" 2>&1
                  tail -4 "$out/structured_profile.log" ;;
    decode) python3 bench/decode.py --shapes smollm2-135m llama3-8b --batches 1 8 64 --static-batches 1 \
              --out "$out/decode.json" ${DECODE_ARGS:-} 2>&1 | tee "$out/decode.log" | grep -v "^{" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
