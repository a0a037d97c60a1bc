#!/usr/bin/env bash
# fails when the repository or its configured build reaches outside the clone:
# a tracked file that names the developers' shared/ folder beside the clone, or a path in the build's test commands
# and compile definitions that leads out of the source tree (the build folder
# and the system's own folders aside). run after scripts/setup.sh.
#   bash scripts/check_standalone.sh [BUILD_DIR]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd -P)
build=$(cd "${1:-$root/build}" && pwd -P)
cd "$root"
bad=0
if git grep -n -e '[.][.]/shared' -- .; then
  echo "standalone: the files above name a shared/ folder beside the clone, which a user's clone does not have" >&2
  bad=1
fi
# every absolute path in what ctest runs and what the compiler is told, resolved
paths=$( { find "$build" -name CTestTestfile.cmake -exec cat {} +; cat "$build/compile_commands.json"; } |
  grep -oE '/[A-Za-z0-9_.+@%=,/-]+' | sort -u)
while IFS= read -r p; do
  case "$p" in /usr/* | /etc/* | /bin/* | /lib/* | /tmp/* | /dev/* | /proc/*) continue ;; esac
  real=$(realpath -m -- "$p")
  case "$real" in "$root" | "$root"/* | "$build" | "$build"/*) continue ;; esac
  [[ -e "$real" ]] || continue  # not a path (a flag's tail, a URL piece)
  echo "standalone: the build uses $p, outside $root" >&2
  bad=1
done <<<"$paths"
((bad == 0)) && echo "standalone: no file and no configured path leaves $root"
exit "$bad"
