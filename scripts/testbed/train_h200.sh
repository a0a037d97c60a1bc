#!/usr/bin/env bash
# Train the testbed model on one H200 in one command (about 8 minutes), for
# kvblend bench accuracy. Prepared on a CPU machine; run on the device machine:
#
#   bash scripts/testbed/stage_h200.sh          # here: gguf-py and the vocab into .h200/
#   run(command="bash scripts/testbed/train_h200.sh", carry=[".h200"], timeout_s=600)
#   bash scripts/testbed/after_h200.sh FILES_AT  # here: the GGUF back together, checked, benchmarked
#
# Needs torch 2.x with CUDA and numpy there (no internet: nothing is installed).
#
# Size (scripts/testbed/train.py --help): Qwen3 shape, d 256, 8 layers, 4 query
# heads / 2 KV heads of 64, FFN 1024, tied 32000-token embedding: 16.1M
# parameters (7.9M outside the embedding), q8_0 GGUF ~17 MB (the committed
# model must stay under 20 MB). Training FLOPs per token (train.py's
# flops_per_token: 6 x matmul parameters with the output layer on the 26% of
# positions that have a loss, + attention at ~200 tokens): ~63 MFLOP. At a
# conservative 30% of the H200's ~989 TFLOP/s bf16 dense peak (~300 TFLOP/s),
# 1.5e9 tokens take 1.5e9 x 63e6 / 3e14 = 315 s; --minutes 6.5 caps the loop in
# case the small model runs slower than that (the schedule then follows the
# clock: learning rate and curriculum track max(tokens, time) progress).
# Data: worlds.py prompts made on the fly by 12 worker processes (~0.5M
# tokens/s per core measured on a 2-core CPU machine).
#
# Brings back (at most 8 files of 16 MiB under $OUT): train.log (stdout and
# the GPU), log.jsonl (the training curve and dev evaluations), eval.json
# (greedy exact match on dev.jsonl, full prefill and naive concatenation, every
# answer), ref.json (tokens and logits of 8 dev prompts for
# tests/graph/test_testbed_export.cpp), model.gguf in two parts and its sha256.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
stage=${KVBLEND_H200_STAGE:-.h200}
out=${OUT:?set OUT to the folder whose files come back}
run=${KVBLEND_H200_RUN:-/tmp/testbed-run}
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}  # a python with torch 2.x (CUDA) and numpy
[[ -d $stage/llama/gguf-py ]] || { echo "train_h200: run scripts/testbed/stage_h200.sh and carry .h200" >&2; exit 1; }
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  "$py" -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__, 'cuda', torch.cuda.is_available())"
  nproc
} 2>&1 | tee "$out/train.log"
rm -rf "$run"
"$py" scripts/testbed/train.py --out "$run" --llama-dir "$stage/llama" \
  --device cuda --threads 4 --workers 12 \
  --d-model 256 --layers 8 --heads 4 --kv-heads 2 --head-dim 64 --ffn 1024 --ctx 1024 \
  --batch 512 --lr 2e-3 --warmup 200 --min-lr-frac 0.05 --wd 0.1 --lm-weight 0.25 --lm-frac 0.25 \
  --min-people 3 --max-people 6 --curriculum 0.3 \
  --tokens 1.5e9 --minutes 6.5 --log-every 100 --eval-every 2000 --eval-n 400 --ckpt-every 3 \
  --export-type q8_0 --ref-n 8 ${KVBLEND_H200_EXTRA:-} 2>&1 | tee -a "$out/train.log"
cp "$run/log.jsonl" "$run/eval.json" "$run/ref.json" "$out/"
split -b 15M -d "$run/model.gguf" "$out/model.gguf.part"
(cd "$run" && sha256sum model.gguf) > "$out/model.gguf.sha256"
ls -la "$out"
