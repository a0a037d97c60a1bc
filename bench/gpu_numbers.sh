#!/usr/bin/env bash
# kvblend's numbers on an NVIDIA GPU in one run (docs/BENCHMARKS.md, "On an
# NVIDIA GPU"): synthetic models of two real shapes (qwen3-0.6b, llama-8b),
# then ours vs libllama's prefill and decode, the blend at 8k and 32k tokens vs
# libllama's full prefill, store loads vs collecting, the energy table (NVML),
# the server under concurrent clients, and the forward/fusion tests on the GPU.
# Every step has its own time limit and log; a failed step does not stop the
# others.
#
#   bench/gpu_numbers.sh OUT_DIR [STEP ...]
#     steps: info models tests prefill blend store energy serve (default: all, in this order)
#
#   KVBLEND        the CUDA build's CLI (default build-cuda/bin/kvblend; KVBLEND_CUDA=1 scripts/setup.sh)
#   KVBLEND_TESTS  its test program (default build-cuda/bin/kvblend_tests; the tests step needs it)
#   LLAMA_SERVER   llama-server built on the same ggml (optional: the serve step's peer)
#   MODELS_DIR     where the synthetic models go (default /tmp/kvblend-gpu-models)
#   VOCAB_DIR      the vocabulary GGUFs (default third_party/llama.cpp/models)
#   THREADS        CPU threads of both engines (default 8)
#   SMALL, LARGE   the two models as PRESET:VOCAB (default qwen3-0.6b:qwen2, llama-8b:llama-bpe)
#   PREFILL_TOKENS, BLEND_CONTEXTS  prompt lengths (default 512,2048,8192 and 8192,32768)
#   BUDGET_S       seconds for the whole run: a step gets at most what is left, and is
#                  skipped with under 20 s left (default: no budget)
#   DEVICE         the energy table's --device (default cuda; the benches take the build's first GPU)
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: bench/gpu_numbers.sh OUT_DIR [STEP ...]}
shift
steps=("$@")
((${#steps[@]})) || steps=(info models tests prefill blend store energy serve)
mkdir -p "$out"
out=$(cd "$out" && pwd)

kvb=${KVBLEND:-$root/build-cuda/bin/kvblend}
tests_bin=${KVBLEND_TESTS:-$root/build-cuda/bin/kvblend_tests}
models=${MODELS_DIR:-/tmp/kvblend-gpu-models}
vocab=${VOCAB_DIR:-$root/third_party/llama.cpp/models}
threads=${THREADS:-8}
small_preset=${SMALL:-qwen3-0.6b:qwen2}
large_preset=${LARGE:-llama-8b:llama-bpe}
small_name=${small_preset%%:*} large_name=${large_preset%%:*} large_vocab=${large_preset#*:}
small=$models/$small_name-q8_0.gguf
large=$models/$large_name-q8_0.gguf
prefill_tokens=${PREFILL_TOKENS:-512,2048,8192}
blend_contexts=${BLEND_CONTEXTS:-8192,32768}
mkdir -p "$models"

# step NAME LIMIT_S: runs run_NAME with its output in OUT/NAME.log, and one
# line per step (status, seconds) in OUT/summary.txt
step() {
  local name=$1 limit=$2 t0=$SECONDS
  if [[ -n ${BUDGET_S:-} ]]; then
    local left=$((BUDGET_S - SECONDS))
    if ((left < 20)); then
      printf '%-10s skipped: %ss of the budget left\n' "$name" "$left" | tee -a "$out/summary.txt"
      return 1
    fi
    ((limit > left)) && limit=$left
  fi
  echo "== $name ($(date -u +%T))" >>"$out/$name.log"
  timeout --kill-after=10 "$limit" bash -c "run_$name" >>"$out/$name.log" 2>&1
  local rc=$?
  printf '%-10s rc=%-3s %4ss\n' "$name" "$rc" $((SECONDS - t0)) | tee -a "$out/summary.txt"
  return $rc
}

make_model() {  # PRESET TYPE VOCAB OUT
  [[ -s $4 ]] || "$kvb" make-model --preset "$1" --type "$2" --vocab-from "$vocab/ggml-vocab-$3.gguf" -o "$4"
}

# wait until URL/health answers, at most N seconds
wait_health() {
  for _ in $(seq 1 "$2"); do
    if command -v curl >/dev/null; then
      curl -sf "$1/health" >/dev/null 2>&1 && return 0
    else
      python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + "/health", timeout=2)' "$1" \
        >/dev/null 2>&1 && return 0
    fi
    sleep 1
  done
  echo "no answer from $1 after $2 s" >&2
  return 1
}

run_info() {
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.mem,power.limit --format=csv
  grep -m1 'model name' /proc/cpuinfo
  nproc
  "$kvb" generate --list-devices
}

run_models() {
  make_model "$small_name" q8_0 "${small_preset#*:}" "$small" &&
    make_model "$large_name" q8_0 "$large_vocab" "$large" &&
    ls -la "$models"
}

# the forward and the fusion on the GPU against libllama: the suites whose models
# the test program makes itself (tiny presets) or finds in models/
run_tests() {
  "$tests_bin" \
    --gtest_filter='forward_equiv*:models/forward_equiv.*:models/eval_seqs_test.*:families/blend_family.*:blend.*:eval_seqs.*'
}

run_prefill() {
  "$kvb" bench prefill -m "$small" --tokens "$prefill_tokens" --n-gen 64 -r 3 -t "$threads" --energy --json \
    >"$out/prefill-$small_name.json" &&
    "$kvb" bench prefill -m "$large" --tokens "$prefill_tokens" --n-gen 64 -r 3 -t "$threads" --energy --json \
      >"$out/prefill-$large_name.json"
}

run_blend() {
  "$kvb" bench blend -m "$small" --context "$blend_contexts" -r 3 -t "$threads" --energy \
    --json "$out/blend-$small_name.json" &&
    "$kvb" bench blend -m "$large" --context "$blend_contexts" -r 2 -t "$threads" --energy \
      --json "$out/blend-$large_name.json"
}

run_store() {
  "$kvb" bench store -m "$small" --chunk 512 --n 4 -t "$threads" --json "$out/store-$small_name.json" &&
    "$kvb" bench store -m "$large" --chunk 512 --n 4 -t "$threads" --json "$out/store-$large_name.json"
}

# the seeds' table on the large model: f16, q8_0 and q4_0 weights
run_energy() {
  make_model "$large_name" f16 "$large_vocab" "$models/$large_name-f16.gguf" &&
    make_model "$large_name" q4_0 "$large_vocab" "$models/$large_name-q4_0.gguf" &&
    python3 "$root/bench/energy_table.py" -m "$models/$large_name-f16.gguf" --model-q8 "$large" \
      --model-q4 "$models/$large_name-q4_0.gguf" --kvblend "$kvb" --device "${DEVICE:-cuda}" --docs 4 \
      --doc-words 384 -n 128 -r 2 -t "$threads" --json "$out/energy-$large_name.json"
}

# 8 slots each; kvblend's -c is per slot, llama-server's is shared by its slots
run_serve() {
  local pids=() peer=() rc=0
  "$kvb" serve -m "$large" --port 18700 --parallel 8 -c 8192 -t "$threads" --quiet &
  pids+=($!)
  if [[ -n ${LLAMA_SERVER:-} ]]; then
    "$LLAMA_SERVER" -m "$large" --port 18701 -np 8 -c 65536 -t "$threads" -ngl 999 --no-webui \
      >"$out/llama-server.log" 2>&1 &
    pids+=($!)
    peer=(--peer http://127.0.0.1:18701)
  fi
  wait_health http://127.0.0.1:18700 120 && { ((${#peer[@]} == 0)) || wait_health http://127.0.0.1:18701 120; } &&
    "$kvb" bench serve -m "$large" --url http://127.0.0.1:18700 "${peer[@]}" --clients 1,4,8,16 --mode plain \
      --requests-per-client 2 --max-tokens 64 --seed 7 --json "$out/serve-plain-$large_name.json" &&
    "$kvb" bench serve -m "$large" --url http://127.0.0.1:18700 "${peer[@]}" --clients 1,4,8,16 --mode rag \
      --requests-per-client 2 --max-tokens 64 --seed 7 --json "$out/serve-rag-$large_name.json" || rc=$?
  kill "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  return $rc
}

export root out kvb tests_bin models vocab threads small large small_name large_name large_vocab \
  small_preset prefill_tokens blend_contexts
export -f make_model wait_health run_info run_models run_tests run_prefill run_blend run_store run_energy run_serve
declare -A limit=([info]=30 [models]=240 [tests]=120 [prefill]=240 [blend]=300 [store]=120 [energy]=360 [serve]=300)
for s in "${steps[@]}"; do
  [[ -n ${limit[$s]:-} ]] || { echo "unknown step '$s'" >&2; exit 2; }
  # without the device or the models nothing after can run
  step "$s" "${limit[$s]}" || [[ $s != info && $s != models ]] || break
done
