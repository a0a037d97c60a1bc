#!/usr/bin/env bash
# stage what scripts/testbed/train_h200.sh needs beside the source into .h200/
# (git-ignored): the device tool sends the checkout only, not the third_party/
# link (the testbed generator and its dev set travel with the checkout).
# Run it in the checkout the device tool sends, then:
#   run(command="bash scripts/testbed/train_h200.sh", carry=[".h200"], timeout_s=600)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"
llama=$root/third_party/llama.cpp
rm -rf .h200
mkdir -p .h200/llama/models
cp -rL "$llama/gguf-py" .h200/llama/
rm -rf .h200/llama/gguf-py/tests .h200/llama/gguf-py/examples
cp -L "$llama/models/ggml-vocab-llama-spm.gguf" .h200/llama/models/
git check-ignore -q .h200 || { echo "stage_h200: .h200 is not git-ignored" >&2; exit 1; }
du -sh .h200
