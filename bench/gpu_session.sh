#!/usr/bin/env bash
# One device session, in stages, logs under $OUT (or ./out). Run on the GPU machine from the repository root:
#   bench/gpu_session.sh tests kernels breakdown structured     # ~4 min
#   bench/gpu_session.sh decode                                 # ~5 min: bench/decode.py, both shapes, HF in the same run
# Stages: tests (GPU tests), kernels (bench/kernels.py), breakdown (bench/step_breakdown.py, SmolLM2 batch 1 and
# Llama-3-8B shape with 8 layers), structured (bench/structured.py on random SmolLM2 weights; needs the real
# tokenizer files in $TOKENIZER_DIR, default .bench-tokenizer), structured-profile (the same at batch 1 with the
# engine steps' host profile, into structured_profile.log), sweep (SmolLM2 batch 1 step time under tuning variants:
# bench/step_breakdown.py --set/--skip-pass), gemv-sweep (bench/gemv_sweep.py: the decode GEMV against cuBLAS at
# Llama-3-8B shapes under tiling variants), decode (bench/decode.py).
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
    kernels) python3 bench/kernels.py 2>&1 | tee "$out/kernels.log" | grep -v Warning ;;
    breakdown) for args in "--shape smollm2-135m --batch 1" "--shape smollm2-135m --batch 64 --top 8" \
                           "--shape llama3-8b --layers 8 --batch 1 --top 8"; do
                 python3 bench/step_breakdown.py $args 2>&1 | grep -v Warning
                 # The same without programmatic dependent launch, to measure what it gives.
                 KILN_PDL=0 python3 bench/step_breakdown.py $args --top 0 2>&1 | grep -v Warning | head -1 | sed 's/^/KILN_PDL=0 /'
               done | tee "$out/breakdown.log" ;;
    sweep) ad=kiln.kernels.attention_decode lf=kiln.kernels.linear_fused
           for variant in "" "--skip-pass fuse_rope_attention" "--set $ad.MIN_SPLIT_TOKENS=64" \
                          "--set $ad.MIN_SPLIT_TOKENS=32" "--set $ad.MIN_SPLIT_TOKENS=4096" \
                          "--set $lf.GEMV_PROGRAMS_PER_SM=4" "--set $lf.GEMV_NUM_WARPS=2" ""; do
             python3 bench/step_breakdown.py --shape smollm2-135m --batch 1 --top 0 $variant 2>&1 | grep "engine step"
           done | tee "$out/sweep.log" ;;
    gemv-sweep) n8="GEMV_BLOCK_N=(4,8)"
                python3 bench/gemv_sweep.py --tokens 1 --variant "$n8" --variant "$n8 GEMV_RESIDENT_PER_SM=3" \
                  --variant "$n8 GEMV_RESIDENT_PER_SM=4" --variant "$n8 GEMV_RESIDENT_PER_SM=1" --variant "" \
                  --variant "$n8 GEMV_RESIDENT_PER_SM=1000" --variant "GEMV_BLOCK_N=(4,4) GEMV_BLOCK_K=(64,2048)" \
                  --variant "$n8 GEMV_NUM_WARPS=8" 2>&1 | tee "$out/gemv_sweep.log" | grep "|"
                python3 bench/gemv_sweep.py --tokens 8 --variant "" --variant "GEMV_DOT_BLOCK_K=256" 2>&1 \
                  | tee -a "$out/gemv_sweep.log" | grep "|" ;;
    structured) python3 bench/structured.py --random-shape smollm2-135m --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" \
                  --batches 1 16 2>&1 | tee "$out/structured.log" | tail -6 ;;
    structured-profile) python3 bench/structured.py --random-shape smollm2-135m \
                  --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" --batches 1 --profile > "$out/structured_profile.log" 2>&1
                  tail -4 "$out/structured_profile.log" ;;
    decode) python3 bench/decode.py --shapes smollm2-135m llama3-8b --batches 1 8 64 --static-batches 1 \
              --out "$out/decode.json" 2>&1 | tee "$out/decode.log" | grep -v "^{" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
