#!/usr/bin/env bash
# Installs the build into a temporary prefix, then builds a consumer with find_package and
# another with pkg-config, and runs both against a small file. Cleans up after itself.
set -euo pipefail
build_dir=$1
source_dir=$2
work=$(mktemp -d /tmp/ea-package-test-XXXXXX)
trap 'rm -rf "$work"; rm -f /dev/shm/ea-package-test-$$' EXIT
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
head -c 3000000 /dev/urandom > "$work/model.bin"

cmake -S "$source_dir/tests/package/consumer" -B "$work/consumer" -G Ninja \
  -DCMAKE_PREFIX_PATH="$work/prefix" >/dev/null
cmake --build "$work/consumer" >/dev/null
LD_LIBRARY_PATH="$work/prefix/lib" "$work/consumer/consumer" "$work/model.bin" | grep -q "^private 1 "
LD_LIBRARY_PATH="$work/prefix/lib" "$work/consumer/consumer" "$work/model.bin" \
  /dev/shm/ea-package-test-$$ 2>/dev/null | grep -q "^loaded 1 "

libdir=$(ls -d "$work"/prefix/lib*/pkgconfig | head -1)
PKG_CONFIG_PATH=$libdir g++ -std=c++20 "$source_dir/tests/package/consumer/main.cc" \
  $(PKG_CONFIG_PATH=$libdir pkg-config --cflags --libs expert_arena) -o "$work/pc-consumer"
LD_LIBRARY_PATH="$work/prefix/lib" "$work/pc-consumer" "$work/model.bin" \
  /dev/shm/ea-package-test-$$ 2>/dev/null | grep -q "^attached 1 "
echo "package test: CMake package and pkg-config consumers built and ran"
