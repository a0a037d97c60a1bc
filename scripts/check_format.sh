#!/usr/bin/env bash
# fails when a tracked C/C++ source differs from what clang-format makes of it
# (.clang-format at the root); `scripts/check_format.sh --fix` rewrites them instead
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
mapfile -t files < <(git ls-files '*.c' '*.h' '*.cpp' '*.hpp')
if [[ "${1:-}" == --fix ]]; then
  clang-format -i "${files[@]}"
else
  clang-format --dry-run --Werror "${files[@]}"
  echo "format: ${#files[@]} files as .clang-format makes them"
fi
