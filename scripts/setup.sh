#!/usr/bin/env bash
# set up a fresh Debian 12 machine for kvblend and build it into build/.
# idempotent: installs only missing packages, fetches the pinned llama.cpp
# source once, and lets cmake/ninja rebuild only what changed.
#
# environment knobs:
#   KVBLEND_BUILD_DIR   build folder (default: build; build-sanitize with KVBLEND_SANITIZE=1,
#                       build-tsan with KVBLEND_SANITIZE=thread)
#   KVBLEND_SANITIZE=1  build kvblend with ASan + UBSan (ggml and libllama stay uninstrumented)
#   KVBLEND_SANITIZE=thread  with ThreadSanitizer instead
#   KVBLEND_CUDA=1      build the CUDA backend too (needs the CUDA toolkit), into build-cuda
#   KVBLEND_CUDA_ARCH   CUDA architectures to compile for (e.g. 90 for H100/H200; default:
#                       the GPUs of this machine; set it on a machine without one)
#   KVBLEND_NATIVE=0    do not tune for this CPU (GGML_NATIVE off)
#   KVBLEND_JOBS        parallel build jobs (default: number of cores)
#   KVBLEND_TRAIN=1     also install the testbed trainer's packages (scripts/testbed/:
#                       Debian's PyTorch, numpy, OpenBLAS; large, not needed to build or test)
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

LLAMA_NPM_PKG="node-llama-cpp@3.21.1"
LLAMA_COMMIT="80fb11ac73e66d89eae2c6a91d8a77428fa733ed"
LLAMA_DIR="$root/third_party/llama.cpp"
SANITIZE="${KVBLEND_SANITIZE:-0}"
if [[ "$SANITIZE" == 1 ]]; then BUILD_DIR="${KVBLEND_BUILD_DIR:-build-sanitize}"
elif [[ "$SANITIZE" == thread ]]; then BUILD_DIR="${KVBLEND_BUILD_DIR:-build-tsan}"
elif [[ "${KVBLEND_CUDA:-0}" == 1 ]]; then BUILD_DIR="${KVBLEND_BUILD_DIR:-build-cuda}"
else BUILD_DIR="${KVBLEND_BUILD_DIR:-build}"; fi
JOBS="${KVBLEND_JOBS:-$(nproc)}"

log() { printf '[setup] %s\n' "$*"; }

# --- debian packages -------------------------------------------------------
pkgs=(build-essential cmake ninja-build git ca-certificates libgtest-dev nlohmann-json3-dev npm gnuplot-nox
      libxxhash-dev libhiredis-dev redis-server python3-pytest pkgconf
      haproxy                     # the balanced deployment and its test (scripts/deploy_local.sh)
      clang libclang-rt-14-dev    # clang + its sanitizer/libFuzzer runtimes: scripts/fuzz.sh
      clang-format                # scripts/check_format.sh (.ci/run)
      ccache                      # ggml and libllama compiled once for the main and ASan builds
      chromium)                   # the server's page tested in a real browser (tests/server/node/web_page.mjs)
# the trainer runs on Debian's python3 (/usr/bin/python3); torch without OpenBLAS falls back to the reference BLAS
[[ "${KVBLEND_TRAIN:-0}" == 1 ]] && pkgs+=(python3-torch python3-numpy libopenblas0-pthread)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# npm may come from a non-debian node install: accept it when it runs
if [[ " ${missing[*]} " == *" npm "* ]] && command -v npm >/dev/null 2>&1; then
  missing=("${missing[@]/npm/}")
fi
read -r -a missing <<<"${missing[*]:-}"
if ((${#missing[@]})); then
  log "installing: ${missing[*]}"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
else
  log "debian packages present"
fi

# --- pinned llama.cpp source (from the npm package's git bundle) -----------
have_commit() { [[ -d "$LLAMA_DIR/.git" ]] && [[ $(git -C "$LLAMA_DIR" rev-parse HEAD 2>/dev/null) == "$LLAMA_COMMIT" ]]; }
if have_commit; then
  log "llama.cpp $LLAMA_COMMIT present"
else
  log "fetching llama.cpp from $LLAMA_NPM_PKG"
  tmp=$(mktemp -d)
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent "$LLAMA_NPM_PKG" >/dev/null)
  tar -xzf "$tmp"/node-llama-cpp-*.tgz -C "$tmp" package/llama/gitRelease.bundle
  rm -rf "$LLAMA_DIR"
  mkdir -p "$(dirname "$LLAMA_DIR")"
  git -c advice.detachedHead=false clone -q "$tmp/package/llama/gitRelease.bundle" "$LLAMA_DIR"
  git -C "$LLAMA_DIR" -c advice.detachedHead=false checkout -q "$LLAMA_COMMIT"
  have_commit || { echo "llama.cpp bundle is not at the pinned commit $LLAMA_COMMIT" >&2; exit 1; }
  git -C "$LLAMA_DIR" fsck --no-dangling --no-progress >/dev/null 2>&1 || { echo "llama.cpp bundle failed git fsck" >&2; exit 1; }
  log "llama.cpp verified at $LLAMA_COMMIT"
fi

# --- npm clients for the server tests: openai, Anthropic, LangChain.js -----------------
client_dir="$root/tests/server/node"
# every dependency of its package.json installed at its pinned version
clients_present() {
  node -e '
    const fs = require("fs"), dir = process.argv[1];
    const deps = JSON.parse(fs.readFileSync(dir + "/package.json", "utf8")).dependencies;
    for (const [name, version] of Object.entries(deps)) {
      const p = dir + "/node_modules/" + name + "/package.json";
      if (!fs.existsSync(p) || JSON.parse(fs.readFileSync(p, "utf8")).version !== version) process.exit(1);
    }' "$client_dir" 2>/dev/null
}
if clients_present; then
  log "npm clients present"
else
  log "installing the npm clients (openai, @anthropic-ai/sdk, @langchain/openai, @langchain/core, @langchain/classic, playwright-core)"
  (cd "$client_dir" && npm install --silent --no-audit --no-fund --no-package-lock >/dev/null)
fi

# --- build -----------------------------------------------------------------
cmake_args=(-S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release)
[[ "${KVBLEND_NATIVE:-1}" == 0 ]] && cmake_args+=(-DGGML_NATIVE=OFF) || cmake_args+=(-DGGML_NATIVE=ON)
if [[ "${KVBLEND_CUDA:-0}" == 1 ]]; then
  cmake_args+=(-DKVBLEND_CUDA=ON)
  # the toolkit's standard place, when nvcc is not on PATH
  if ! command -v nvcc >/dev/null 2>&1 && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    cmake_args+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  fi
  # a bare "90" would also embed PTX: "90-real" compiles the device code once
  arch="${KVBLEND_CUDA_ARCH:-}"
  [[ "$arch" =~ ^[0-9]+[af]?$ ]] && arch="$arch-real"
  [[ -n "$arch" ]] && cmake_args+=("-DCMAKE_CUDA_ARCHITECTURES=$arch")
else
  cmake_args+=(-DKVBLEND_CUDA=OFF)
fi
# ggml and libllama compile with the same flags in every build folder but the
# TSan one: through ccache, with paths taken relative to the clone, the ASan
# build (and any rebuild) gets their objects from the main build's compile
if command -v ccache >/dev/null 2>&1; then
  launcher="/usr/bin/env;CCACHE_BASEDIR=$root;ccache"
  cmake_args+=("-DCMAKE_C_COMPILER_LAUNCHER=$launcher" "-DCMAKE_CXX_COMPILER_LAUNCHER=$launcher")
fi
[[ "$SANITIZE" == 1 ]] && cmake_args+=(-DKVBLEND_SANITIZE=ON) || cmake_args+=(-DKVBLEND_SANITIZE=OFF)
[[ "$SANITIZE" == thread ]] && cmake_args+=(-DKVBLEND_TSAN=ON) || cmake_args+=(-DKVBLEND_TSAN=OFF)
log "configuring $BUILD_DIR"
cmake "${cmake_args[@]}" >/dev/null
log "building ($JOBS jobs)"
cmake --build "$BUILD_DIR" -j "$JOBS"
log "done: binaries in $BUILD_DIR/bin"
