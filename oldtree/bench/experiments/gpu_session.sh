#!/usr/bin/env bash
# One device session, in stages, logs under $OUT (or ./out). Run on the GPU machine from the repository root:
#   bench/experiments/gpu_session.sh tests kernels breakdown structured     # ~4 min
#   bench/experiments/gpu_session.sh decode                                 # ~5 min: bench/decode.py, both shapes, HF in the same run
# Stages: tests (GPU tests), kernels (bench/kernel_bench.py), breakdown (bench/experiments/step_breakdown.py with --timeline, SmolLM2 batch 1 and
# Llama-3-8B shape with 8 layers), structured (bench/structured.py on random SmolLM2 weights; needs the real
# tokenizer files in $TOKENIZER_DIR, default .bench-tokenizer), structured-profile (the same at batch 1 with the
# engine steps' host profile, into structured_profile.log), structured-served (the schema through kiln serve at 16
# and 64 concurrent against unconstrained outputs of the same length, ~3 min), grammar-fill (xgrammar's mask
# fill on this host by grammar position and thread count, CPU only), sweep (SmolLM2 batch 1 step time under tuning variants:
# bench/experiments/step_breakdown.py --kernel-config/--skip-pass), gemv-sweep (bench/experiments/gemv_sweep.py: the decode GEMV against cuBLAS at
# Llama-3-8B shapes under tiling variants), few-rows (the few-row GEMV against the tl.dot GEMV and cuBLAS at 2-8 rows,
# and the verify step with it: ~6 min), gemv-policy (Llama-3-8B step under each one-row GEMV weight bound),
# prefill (bench/experiments/prefill_breakdown.py: host and GPU time of a prefill, graphs and eager), decode (bench/decode.py; extra arguments in $DECODE_ARGS, e.g. "--batches 1 --kernel-config NAME=VALUE").
# The open issues' figures, each stage its GPU tests first (a failing test does not stop the stage's benchmark):
#   lora (#23, ~4 min), spec (#24, ~3 min), quant (#27, ~6 min), mma (#27: gemv_mma's fp8 and int8 layer timings, ~3 min), moe (#22, ~4 min), startup and serving (#29,
#   ~2 and ~6 min; need $TOKENIZER_DIR; $SERVING_SHAPES picks the shapes, $SERVE_ARGS replaces the
#   kiln serve flags "--api-server-count 4", $LOAD_WORKERS the load processes, 4), structured (#29). Each step has its own time limit.
set -uo pipefail
out="${OUT:-out}"
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# Printed, not saved: a call brings back at most 8 files, which the stages' logs and figures already take.
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv,noheader
df -h /tmp "$PWD" | tail -n +2
# Waits until the server on port $1 (logging to $2) answers /health and has captured its decode and prefill
# graphs while idle (EngineCore.warm_up_idle), as the offline engine does before its clock starts.
wait_for_server() {
  python3 -c "import time, httpx
for _ in range(1200):
    try:
        if httpx.get('http://127.0.0.1:$1/health', timeout=2).status_code == 200: break
    except httpx.TransportError: pass
    time.sleep(0.5)"
  for _ in $(seq 120); do grep -q "step graphs:" "$2" && break; sleep 0.5; done
  grep "ready in\|step graphs:" "$2"
}
# Issue 29's served-vs-offline rows for one shape: the offline engine at 64 and 256 running (the first
# run also writes the artifact), then one server and the load generator at 1, 64 and 256 concurrent
# and 1024 with a queue limit (refused requests are 503s, none lost).
serving_figures() {
  # $LOAD_WORKERS load processes (default 4; 8 tells whether 4 held the client back at 256 concurrent).
  local shape=$1 art=/tmp/$1.kiln port=30000 workers=${LOAD_WORKERS:-4}
  timeout 300 python3 bench/offline.py --shape "$shape" --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" \
    --save-artifact "$art" --workload random --num-requests 512 --input-len 256 --output-len 128 --max-running 64 \
    --out "$out/offline_${shape}_64.json" | tail -1
  timeout 200 python3 bench/offline.py --model "$art" --workload random --num-requests 512 --input-len 256 \
    --output-len 128 --max-running 256 --out "$out/offline_${shape}_256.json" | tail -1
  python3 -m kiln serve "$art" --port $port --mem-fraction 0.5 --served-model-name m --max-queued-requests 512 \
    ${SERVE_ARGS:---api-server-count 4} > "$out/serve_$shape.log" 2>&1 &
  local server=$!
  wait_for_server $port "$out/serve_$shape.log"
  for c in 1 64 256 1024; do
    local n=$(( c == 1 ? 16 : (c == 1024 ? 1024 : 512) ))
    timeout 300 python3 bench/serving.py --base-url http://127.0.0.1:$port --model m --num-prompts $n \
      --input-len 256 --output-len 128 --ignore-eos --max-concurrency $c --workers $(( c < workers ? c : workers )) \
      --out "$out/served_${shape}_$c.json" 2>&1 | tail -12
  done
  # Each server process's CPU per output token at 256 concurrent (bench/experiments/server_cpu.py).
  timeout 120 python3 bench/experiments/server_cpu.py --server-pid $server -- --base-url http://127.0.0.1:$port \
    --model m --num-prompts 512 --input-len 256 --output-len 128 --ignore-eos --max-concurrency 256 --workers $workers \
    2>&1 | grep -A9 "output tokens in"
  kill $server; wait $server
  rm -rf "$art"  # Llama-3-8B's is 16 GB of the machine's 64 GB disk
}
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
    few-rows) # The few-row GEMV (gemv_few_rows.py, off by default) against the tl.dot GEMV and cuBLAS at 2-8
              # rows, then the speculative verify step (5 and 9 rows a sequence) with and without it.
              python3 bench/experiments/gemv_sweep.py --tokens 2 5 8 --variant "" --variant "gemv_few_rows_max=8" 2>&1 \
                | tee "$out/few_rows.log" | grep "|"
              for v in "" "--kernel-config gemv_few_rows_max=8"; do
                timeout 240 python3 bench/spec_decode.py --shape llama3-8b --draft-tokens 4 --new-tokens 256 --drafters oracle $v \
                  2>&1 | grep -v Warning | tail -2 | tee -a "$out/few_rows.log"
              done ;;
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
    structured-served) # The same schema through kiln serve (SmolLM2's shape, 4 API servers, the load from 4
                       # processes): TPOT at 16 and 64 concurrent, then unconstrained at the constrained outputs' mean length.
                       art=/tmp/smollm2-135m.kiln
                       [ -d "$art" ] || timeout 300 python3 bench/offline.py --shape smollm2-135m --tokenizer-dir \
                         "${TOKENIZER_DIR:-.bench-tokenizer}" --save-artifact "$art" --workload random --num-requests 8 \
                         --input-len 256 --output-len 2 > /dev/null 2>&1
                       python3 -m kiln serve "$art" --port 30001 --mem-fraction 0.5 --served-model-name m \
                         --api-server-count 4 > "$out/serve_structured.log" 2>&1 &
                       server=$!
                       wait_for_server 30001 "$out/serve_structured.log"
                       for c in 16 64; do
                         load="--base-url http://127.0.0.1:30001 --model m --endpoint chat --num-prompts $((4 * c)) --input-len 64
                           --max-concurrency $c --workers 4"
                         timeout 200 python3 bench/serving.py $load --output-len 128 --json-schema bench/person_schema.json \
                           --out "$out/structured_served_$c.json" 2>&1 | tail -9
                         tokens=$(python3 -c "import json; r = json.load(open('$out/structured_served_$c.json'))
print(max(2, round(r['output_tokens'] / max(1, r['completed']))))")
                         timeout 200 python3 bench/serving.py $load --output-len "$tokens" --ignore-eos \
                           --out "$out/free_served_$c.json" 2>&1 | tail -9
                       done 2>&1 | tee "$out/structured_served.log"
                       kill $server; wait $server ;;
    grammar-fill) python3 bench/experiments/grammar_fill.py --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" \
                    --threads 1 2 4 8 15 2>&1 | grep -v Warning | tee "$out/grammar_fill.log" ;;
    structured-profile) python3 bench/structured.py --random-shape smollm2-135m \
                  --tokenizer-dir "${TOKENIZER_DIR:-.bench-tokenizer}" --batches 1 --profile > "$out/structured_profile.log" 2>&1
                  tail -4 "$out/structured_profile.log" ;;
    decode) python3 bench/decode.py --shapes smollm2-135m llama3-8b --batches 1 8 64 --static-batches 1 \
              --out "$out/decode.json" ${DECODE_ARGS:-} 2>&1 | tee "$out/decode.log" | grep -v "^{" ;;
    lora) python3 -m pytest tests/e2e/test_gpu_lora.py -m gpu -q -rfE --tb=line -p no:cacheprovider 2>&1 | tail -15 | tee "$out/lora.log"
          timeout 420 python3 bench/lora_decode.py --shape llama3-8b --batches 1 64 --out "$out/lora.json" 2>&1 \
            | grep -v Warning | tee -a "$out/lora.log"
          timeout 240 python3 bench/experiments/lora_profile.py --layers 8 2>&1 | tail -40 >> "$out/lora.log" ;;
    spec) python3 -m pytest tests/e2e/test_gpu_speculative.py -m gpu -q -rfE --tb=line -p no:cacheprovider 2>&1 | tail -15 | tee "$out/spec.log"
          timeout 420 python3 bench/spec_decode.py --shape llama3-8b --batch 1 --draft-tokens 4 8 --new-tokens 256 \
            --drafters oracle ngram --out "$out/spec.json" 2>&1 | grep -v Warning | tee -a "$out/spec.log" ;;
    quant) python3 -m pytest tests/e2e/test_gpu_quantized.py -m gpu -q -rfE --tb=line -p no:cacheprovider 2>&1 | tail -15 | tee "$out/quant.log"
           timeout 540 python3 bench/decode.py --shapes llama3-8b --batches 1 64 --static-batches \
             --quantization none fp8 mxfp4 w8a8_int8 fp8+lm_head --out "$out/quant.json" 2>&1 | grep -v "^{" | tee -a "$out/quant.log" ;;
    moe) python3 -m pytest tests/e2e/test_gpu_moe.py -m gpu -q -rfE --tb=line -p no:cacheprovider 2>&1 | tail -15 | tee "$out/moe.log"
         timeout 420 python3 bench/moe_decode.py --shapes qwen3-30b-a3b mixtral-8x7b --batches 1 64 \
           --out "$out/moe.json" 2>&1 | grep -v Warning | tee -a "$out/moe.log" ;;
    mma) # gemv_mma (the W8A8 tensor-core GEMV) against the GEMVs other GPUs run and bf16, Llama-3-8B's layer.
         python3 -m pytest tests/kernels/test_gemv_mma.py -q -p no:cacheprovider --tb=line 2>&1 | tail -3 | tee "$out/mma.log"
         timeout 300 python3 bench/experiments/mma_gemv_probe.py --rows 1 5 16 64 --methods fp8 w8a8_int8 \
           --block-k 256 512 --stages 3 4 --quantizes 0 1 --out "$out/mma.json" 2>&1 | grep -v Warning | tee -a "$out/mma.log" ;;
    startup) python3 -m pytest tests/e2e/test_gpu_kernel_cache.py -m gpu -q -rfE --tb=line -p no:cacheprovider 2>&1 | tail -15 \
               | tee "$out/startup.log"
             for shape in smollm2-135m llama3-8b; do
               [ -d "/tmp/$shape.kiln" ] || timeout 300 python3 bench/offline.py --shape "$shape" --tokenizer-dir \
                 "${TOKENIZER_DIR:-.bench-tokenizer}" --save-artifact "/tmp/$shape.kiln" --workload random \
                 --num-requests 8 --input-len 256 --output-len 2 > /dev/null 2>&1
               timeout 300 python3 bench/startup.py --artifact "/tmp/$shape.kiln" --runs 3 --fresh-triton-cache \
                 --out "$out/startup_$shape.json" 2>&1 | tail -8 | tee -a "$out/startup.log"
             done ;;
    serving) for shape in ${SERVING_SHAPES:-smollm2-135m llama3-8b}; do serving_figures "$shape"; done 2>&1 | tee "$out/serving.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
