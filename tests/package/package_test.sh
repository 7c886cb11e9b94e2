#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds a consumer with find_package and
# another with pkg-config, both as a user would build a release (Release / -O3, with
# warnings as errors: the installed headers must not break a user's strict build), and runs
# both against a small GGUF model. Cleans up after itself.
set -euo pipefail
build_dir=$1
source_dir=$2
work=$(mktemp -d /tmp/ea-package-test-XXXXXX)
trap 'rm -rf "$work"; rm -f /dev/shm/ea-package-test-$$' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
# UCX is in the transport plugin, installed next to the library that loads it.
if [[ -e "$build_dir/lib/libexpert_arena_ucx.so" ]] &&
  ! ls "$work"/prefix/lib*/libexpert_arena_ucx.so >/dev/null 2>&1; then
  echo "package test: libexpert_arena_ucx.so is not installed next to libexpert_arena.so" >&2
  exit 1
fi
# And the network process of listening producers and serve, beside the plugin.
if [[ -e "$build_dir/lib/expert-arena-net" ]] &&
  ! ls "$work"/prefix/lib*/expert-arena-net >/dev/null 2>&1; then
  echo "package test: expert-arena-net is not installed next to libexpert_arena_ucx.so" >&2
  exit 1
fi
# 2 layers x 4 experts: 6 routed-expert tensors (gate, up, down per layer).
"$build_dir/bin/expert-arena" gen-model --format gguf --out "$work/model.gguf" --layers 2 \
  --experts 4 --hidden 64 --ffn 64 >/dev/null
model=$work/model.gguf

cmake -S "$source_dir/tests/package/consumer" -B "$work/consumer" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS="-Wall -Wextra -Werror" \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib" "$work/consumer/consumer" "$model" | grep -q "^private 6 "
LD_LIBRARY_PATH="$work/prefix/lib" "$work/consumer/consumer" "$model" \
  /dev/shm/ea-package-test-$$ 2>/dev/null | grep -q "^loaded 6 "

libdir=$(ls -d "$work"/prefix/lib*/pkgconfig | head -1)
PKG_CONFIG_PATH=$libdir g++ -std=c++20 -O3 -DNDEBUG -Wall -Wextra -Werror \
  "$source_dir/tests/package/consumer/main.cc" \
  $(PKG_CONFIG_PATH=$libdir pkg-config --cflags --libs expert_arena) -o "$work/pc-consumer"
LD_LIBRARY_PATH="$work/prefix/lib" "$work/pc-consumer" "$model" \
  /dev/shm/ea-package-test-$$ 2>/dev/null | grep -q "^attached 6 "
echo "package test: CMake package and pkg-config consumers built (Release) and ran"
