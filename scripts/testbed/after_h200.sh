#!/usr/bin/env bash
# after scripts/testbed/train_h200.sh: put the GGUF back together from the
# files that came back, check it against libllama and the trainer
# (scripts/testbed/check_export.py), and run kvblend bench accuracy on the dev set.
#   bash scripts/testbed/after_h200.sh FILES_AT [RUN_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
from=${1:?usage: after_h200.sh FILES_AT [RUN_DIR]}
run=${2:-$root/runs/h200}
mkdir -p "$run"
cat "$from"/model.gguf.part* > "$run/model.gguf"
cp "$from/log.jsonl" "$from/eval.json" "$from/ref.json" "$from/train.log" "$run/"
(cd "$run" && sha256sum -c "$from/model.gguf.sha256")
n=${KVBLEND_AFTER_N:-400}  # dev prompts benchmarked
dev=$root/scripts/testbed/dev.jsonl
/usr/bin/python3 "$root/scripts/testbed/check_export.py" "$run" --n "$((n < 100 ? n : 100))" --tol 0.1
# selection variants over the ratios (default 0.02,0.05,0.08,0.15,0.3)
"$root/build/bin/kvblend" bench accuracy -m "$run/model.gguf" --prompts "$dev" --n "$n" \
  --variants default,score=k,score=kv,check=2,head=1,head=2,head=4,prefix,schedule=1@2/4@1 \
  --json "$run/accuracy.json" --plot "$run/accuracy.png" | tee "$run/accuracy.md"
# composition at the default ratio: stored chunks through codecs, the fused cache evicted
"$root/build/bin/kvblend" bench accuracy -m "$run/model.gguf" --prompts "$dev" --n "$n" --ratios 0.08 \
  --codecs q8_0,q4_0,kivi4,cachegen,turboquant4 --evict snapkv:50% \
  --json "$run/composition.json" | tee "$run/composition.md"
