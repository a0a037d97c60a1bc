#!/bin/sh
# cmake --install into a fresh prefix, then use only what was installed:
# the exported symbols and soname of libkvblend.so, a CMake project that
# finds the package (shared and static), pkg-config, the CLI and the binding.
#   test_install.sh BUILD_DIR SOURCE_DIR MODEL.gguf
set -eu
build=$1 src=$2 model=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
fail() { echo "FAIL: $*" >&2; exit 1; }
version=$(sed -n 's/^project(kvblend VERSION \([0-9.]*\).*/\1/p' "$src/CMakeLists.txt")

cmake --install "$build" --prefix "$prefix" >/dev/null
lib=$(ls "$prefix"/lib*/libkvblend.so.*.*.* 2>/dev/null | head -n 1)
[ -n "$lib" ] || fail "no libkvblend.so.X.Y.Z under $prefix"
libdir=$(dirname "$lib")
for f in "$prefix/include/kvblend.h" "$libdir/libkvblend.a" "$libdir/libkvblend.so" "$prefix/bin/kvblend" \
         "$libdir/cmake/kvblend/kvblendConfig.cmake" "$libdir/pkgconfig/kvblend.pc" \
         "$libdir/python3/dist-packages/kvblend/__init__.py"; do
  [ -e "$f" ] || fail "not installed: $f"
done
# nothing of ggml, libllama or the server comes along
extra=$(cd "$prefix" && find . -type f | grep -v -e kvblend -e '^./bin/kvblend$' || true)
[ -z "$extra" ] || fail "installed more than kvblend: $extra"

# the shared object: a versioned soname and only the C API exported
soname=$(objdump -p "$lib" | awk '/SONAME/ {print $2}')
[ "$soname" = libkvblend.so.0 ] || fail "soname is '$soname'"
nm -D --defined-only "$lib" | awk '{print $3}' > "$tmp/syms"
[ -s "$tmp/syms" ] || fail "no exported symbols"
if grep -v '^kvb_' "$tmp/syms"; then fail "symbols other than kvb_* are exported (above)"; fi
# every function kvblend.h declares, and nothing else
grep -o 'kvb_[a-z_]*(' "$prefix/include/kvblend.h" | tr -d '(' | sort -u > "$tmp/declared"
sort "$tmp/syms" | diff "$tmp/declared" - || fail "exported symbols differ from kvblend.h's functions (above)"
echo "libkvblend.so: soname $soname, $(wc -l < "$tmp/syms") symbols, all kvb_*"

docs="$src/examples/docs/ball.txt $src/examples/docs/cat.txt"
# find_package(kvblend): the C example against the shared and the static library
cmake -S "$src/tests/install/consumer" -B "$tmp/consumer" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_BUILD_TYPE=Release \
  -DKVBLEND_WANT="${version%.*}" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
"$tmp/consumer/consumer" "$model" "$tmp/store" "Once upon a time" $docs > "$tmp/out_shared"
"$tmp/consumer/consumer_static" "$model" "$tmp/store" "Once upon a time" $docs > "$tmp/out_static"
grep -q '^chunks: 3 from the store' "$tmp/out_static" || fail "static consumer: $(cat "$tmp/out_static")"
if ldd "$tmp/consumer/consumer_static" | grep -q libkvblend; then fail "the static consumer needs libkvblend.so"; fi
ldd "$tmp/consumer/consumer" | grep -q "libkvblend.so.0 => $libdir" || fail "the shared consumer does not use the installed library"
echo "find_package(kvblend): shared and static consumers run"

# pkg-config, relocatable
export PKG_CONFIG_PATH="$libdir/pkgconfig"
[ "$(pkg-config --modversion kvblend)" = "$version" ] || fail "pkg-config version: want $version"
cc -o "$tmp/pc_consumer" "$src/examples/rag_blend.c" $(pkg-config --cflags --libs kvblend) -Wl,-rpath,"$libdir"
"$tmp/pc_consumer" "$model" "$tmp/store" "Once upon a time" $docs | grep -q '^chunks: 3 from the store' \
  || fail "pkg-config consumer"
cc -o "$tmp/pc_static" "$src/examples/rag_blend.c" $(pkg-config --cflags kvblend) "$libdir/libkvblend.a" \
  $(pkg-config --static --libs-only-l kvblend | sed 's/-lkvblend//')
"$tmp/pc_static" "$model" "$tmp/store" "Once upon a time" $docs | grep -q '^chunks: 3 from the store' \
  || fail "pkg-config static consumer"
echo "pkg-config: shared and static consumers run"

# the installed CLI and the installed binding (which finds the installed library)
"$prefix/bin/kvblend" store stats --store "$tmp/store" | grep -q . || fail "installed CLI"
(cd "$tmp" && env -u KVBLEND_LIB PYTHONPATH="$libdir/python3/dist-packages" /usr/bin/python3 -c "
import kvblend, os, sys
assert os.path.realpath(kvblend.library_path) == os.path.realpath('$lib'), kvblend.library_path
with kvblend.Store('$tmp/store') as st:
    assert st.stats().n_entries == 3, st.stats()
") || fail "installed python binding"
echo "installed CLI and python binding work"

# a prefix with its own Python (a venv): the binding goes where that Python
# looks, and imports with no PYTHONPATH, finding the library beside it
venv=$tmp/venv
/usr/bin/python3 -m venv --without-pip "$venv"
cmake --install "$build" --prefix "$venv" >/dev/null
(cd "$tmp" && env -u KVBLEND_LIB -u PYTHONPATH "$venv/bin/python3" -c "
import kvblend, os, site
assert os.path.dirname(os.path.dirname(kvblend.__file__)) in site.getsitepackages(), kvblend.__file__
assert os.path.realpath(kvblend.library_path).startswith(os.path.realpath('$venv') + os.sep), kvblend.library_path
") || fail "the binding installed into a venv does not import from it"
echo "a venv prefix: the binding imports with no PYTHONPATH"
