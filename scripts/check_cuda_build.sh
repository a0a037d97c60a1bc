#!/usr/bin/env bash
# compile kvblend with ggml's CUDA backend for one architecture (no GPU needed,
# only the CUDA toolkit): run it before touching backend code, since the default
# build and CI never compile the CUDA path. builds into build-cuda (build/ is
# left alone) and prints how long it took.
#
#   KVBLEND_CUDA_ARCH   the architecture (default 90: H100/H200)
#   KVBLEND_JOBS        parallel jobs (default: number of cores)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
t0=$(date +%s)
KVBLEND_CUDA=1 KVBLEND_CUDA_ARCH="${KVBLEND_CUDA_ARCH:-90}" KVBLEND_BUILD_DIR="${KVBLEND_BUILD_DIR:-build-cuda}" \
  bash "$root/scripts/setup.sh"
# the binary must resolve the toolkit's libraries (cudart, cublas); the driver's
# libcuda.so.1 comes with a GPU and may be missing on a build machine
bin="$root/${KVBLEND_BUILD_DIR:-build-cuda}/bin/kvblend"
missing=$(ldd "$bin" | grep 'not found' | grep -v 'libcuda\.so' || true)
if [[ -n "$missing" ]]; then echo "$missing" >&2; echo "check_cuda_build: unresolved libraries" >&2; exit 1; fi
echo "check_cuda_build: built in $(( $(date +%s) - t0 )) s"
