#!/usr/bin/env bash
# run one libFuzzer target of fuzz/ for a while, in a clang build of its own.
#
#   scripts/fuzz.sh NAME SECONDS   fuzz fuzz/fuzz_NAME.cpp (NAME or fuzz_NAME) for SECONDS
#   scripts/fuzz.sh --build        only configure and build every target
#   scripts/fuzz.sh --list         the target names
#   scripts/fuzz.sh --seeds NAME   rewrite fuzz/corpus/NAME/ from the target's seed writer
#
# the seeds in fuzz/corpus/NAME/ are read, never written: what a run finds
# goes to a scratch corpus in the build folder (kept between runs but seeded ones), and a crash
# leaves its input there as crash-* (reproduce: build-fuzz/fuzz/bin/fuzz_NAME FILE).
# exits non-zero when the target crashed, leaked or a sanitizer reported.
#
# environment knobs:
#   KVBLEND_FUZZ_BUILD_DIR  build folder (default: build-fuzz)
#   KVBLEND_BUILD_DIR       the normal build whose ggml and libllama are linked (default: build)
#   KVBLEND_JOBS            parallel build jobs (default: number of cores)
#   KVBLEND_FUZZ_JOBS       parallel fuzzing processes for one target (default 1)
#   KVBLEND_FUZZ_SEED       libFuzzer's random seed (default: a new one each run); the
#                           ctest runs fix it, so CI explores the same inputs every time
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
BUILD_DIR="${KVBLEND_FUZZ_BUILD_DIR:-build-fuzz}"
PREBUILT="$root/${KVBLEND_BUILD_DIR:-build}"  # the normal build (scripts/setup.sh)
JOBS="${KVBLEND_JOBS:-$(nproc)}"

log() { printf '[fuzz] %s\n' "$*" >&2; }
targets() { for f in fuzz/fuzz_*.cpp; do f=${f#fuzz/fuzz_}; echo "${f%.cpp}"; done; }

build() {
  # one build at a time (ctest may start several runs at once)
  mkdir -p "$BUILD_DIR"
  exec 9>"$BUILD_DIR/.build-lock"
  flock 9
  # ggml and libllama come from the normal build, uninstrumented
  [[ -f "$PREBUILT/CMakeCache.txt" ]] || { echo "no build in $PREBUILT: run scripts/setup.sh first" >&2; exit 1; }
  cmake --build "$PREBUILT" --target llama ggml -j "$JOBS" >&2
  if [[ ! -f "$BUILD_DIR/CMakeCache.txt" ]]; then
    command -v clang++ >/dev/null || { echo "clang++ not found: run scripts/setup.sh" >&2; exit 1; }
    log "configuring $BUILD_DIR (clang, ASan + UBSan + libFuzzer on kvblend; ggml and libllama of $PREBUILT)"
    CC=clang CXX=clang++ cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVBLEND_FUZZ=ON \
      -DKVBLEND_TESTS=OFF -DKVBLEND_FUZZ_PREBUILT="$PREBUILT" >/dev/null
  fi
  log "building the fuzz targets ($JOBS jobs)"
  cmake --build "$BUILD_DIR" --target fuzz_targets -j "$JOBS" >&2
  flock -u 9
}

case "${1:-}" in
  --list) targets; exit 0 ;;
  --build) build; exit 0 ;;
  --seeds)
    name=${2:?usage: scripts/fuzz.sh --seeds NAME}; name=${name#fuzz_}
    build
    rm -rf "fuzz/corpus/$name"
    KVBLEND_FUZZ_SEEDS="$root/fuzz/corpus/$name" "$BUILD_DIR/fuzz/bin/fuzz_$name"
    exit 0 ;;
  ""|-h|--help) sed -n '2,18p' "$0"; exit 2 ;;
esac

name=${1#fuzz_}
seconds=${2:?usage: scripts/fuzz.sh NAME SECONDS}
[[ -f "fuzz/fuzz_$name.cpp" ]] || { echo "no fuzz target '$name' (have: $(targets | tr '\n' ' '))" >&2; exit 2; }
[[ "$seconds" =~ ^[0-9]+$ ]] || { echo "SECONDS must be a whole number, got '$seconds'" >&2; exit 2; }
build
bin="$BUILD_DIR/fuzz/bin/fuzz_$name"
work="$BUILD_DIR/fuzz/run/$name"
# a seeded run (ctest's) starts from the seeds alone: what it explores does not
# depend on what earlier runs on this machine left in the scratch corpus
[[ -n "${KVBLEND_FUZZ_SEED:-}" ]] && rm -rf "$work/corpus"
mkdir -p "$work/corpus"
seeds=()
[[ -d "fuzz/corpus/$name" ]] && seeds=("fuzz/corpus/$name")
# inputs that once crashed it, kept by hand (--seeds never rewrites them)
[[ -d "fuzz/regressions/$name" ]] && seeds+=("fuzz/regressions/$name")
log "fuzz_$name for ${seconds}s (seeds: ${seeds[*]:-none}; new inputs in $work/corpus)"
# -rss_limit_mb: the sanitizers' shadow memory counts; -timeout: a slow input is a bug too
cd "$work"
par=()
jobs="${KVBLEND_FUZZ_JOBS:-1}"
((jobs > 1)) && par=(-fork="$jobs")
[[ -n "${KVBLEND_FUZZ_SEED:-}" ]] && par+=(-seed="$KVBLEND_FUZZ_SEED")
exec "$root/$bin" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=4096 -print_final_stats=1 "${par[@]}" \
  corpus "${seeds[@]/#/$root/}"
