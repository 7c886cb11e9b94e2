#!/usr/bin/env bash
# Installs llama.cpp's prebuilt Linux x64 libraries (the npm package @node-llama-cpp/linux-x64)
# and node-llama-cpp, which drives them, into a cache directory outside the source tree, and
# prints the directory holding libllama / libggml-base (bins/linux-x64).
#
#   scripts/llamacpp-peer.sh            install when missing, print the library directory
#   scripts/llamacpp-peer.sh --prefix   print the npm prefix instead (node_modules lives there)
#
# Idempotent: a complete install of the pinned versions is reused without touching the
# network. Only the npm registry is used (npm install); nothing is built. The cache is
# ${EXPERT_ARENA_CACHE:-$HOME/.cache/expert-arena}/npm/node-llama-cpp-<version>.
# Exit 1 with a message on stderr when node/npm are missing or the install fails.
set -euo pipefail

version=${EXPERT_ARENA_LLAMACPP_NPM_VERSION:-3.22.1}
cache=${EXPERT_ARENA_CACHE:-${HOME:-/tmp}/.cache/expert-arena}
prefix="$cache/npm/node-llama-cpp-$version"
libdir="$prefix/node_modules/@node-llama-cpp/linux-x64/bins/linux-x64"
stamp="$prefix/.installed"

if [[ ! -f "$stamp" || ! -f "$libdir/libggml-base.so" ]]; then
  for tool in node npm; do
    if ! command -v "$tool" >/dev/null 2>&1; then
      echo "llamacpp-peer: $tool is not installed (scripts/install-deps.sh installs nodejs and npm)" >&2
      exit 1
    fi
  done
  mkdir -p "$prefix"
  # One installer at a time; a second waits for the first and then finds the stamp.
  exec 9>"$prefix/.lock"
  flock 9
  if [[ ! -f "$stamp" || ! -f "$libdir/libggml-base.so" ]]; then
    echo '{"private": true, "description": "llama.cpp peer for expert-arena tests and benches"}' \
      > "$prefix/package.json"
    # --ignore-scripts: node-llama-cpp's postinstall would look for (or build) other binaries;
    # --omit=optional: only the linux-x64 CPU binaries, named explicitly, are wanted.
    if ! npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --omit=optional \
        --loglevel=error "node-llama-cpp@$version" "@node-llama-cpp/linux-x64@$version" >&2; then
      echo "llamacpp-peer: npm install of node-llama-cpp@$version and" \
        "@node-llama-cpp/linux-x64@$version into $prefix failed" >&2
      exit 1
    fi
    if [[ ! -f "$libdir/libggml-base.so" ]]; then
      echo "llamacpp-peer: $libdir/libggml-base.so is missing after the install" >&2
      exit 1
    fi
    date -u +%FT%TZ > "$stamp"
  fi
fi

if [[ "${1:-}" == "--prefix" ]]; then
  echo "$prefix"
else
  echo "$libdir"
fi
