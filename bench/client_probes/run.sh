#!/usr/bin/env bash
# the client probes against two running servers, same model:
#   bench/client_probes/run.sh URL_KVBLEND URL_LLAMA_SERVER [OUT_DIR]
# e.g. kvblend serve --api-key probe-key --store dir:/tmp/kv --jinja ... --port 18701
#      llama-server --jinja --api-key probe-key ... --port 18702
#      bench/client_probes/run.sh http://127.0.0.1:18701 http://127.0.0.1:18702 /tmp/probes
# prints the markdown table (also OUT_DIR/table.md; the raw results are
# OUT_DIR/openai.json, OUT_DIR/langchain.json and OUT_DIR/apis.json: the
# Responses, Anthropic Messages and native /completion routes). The packages come from
# tests/server/node/node_modules (npm ci there first). PROBE_API_KEY: the
# servers' key (default probe-key); PROBE_ONLY: cases whose name holds it.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[ $# -ge 2 ] || { echo "usage: $0 URL_KVBLEND URL_LLAMA_SERVER [OUT_DIR]" >&2; exit 2; }
out="${3:-/tmp/probes}"
mkdir -p "$out"
[ -d "$here/../../tests/server/node/node_modules/openai" ] ||
  { echo "no tests/server/node/node_modules: run npm ci in tests/server/node" >&2; exit 2; }
node "$here/openai_probes.mjs" "$1" "$2" > "$out/openai.json"
node "$here/langchain_probes.mjs" "$1" "$2" > "$out/langchain.json"
node "$here/api_probes.mjs" "$1" "$2" > "$out/apis.json"
node "$here/table.mjs" "$out/openai.json" "$out/langchain.json" "$out/apis.json" | tee "$out/table.md"
