#!/usr/bin/env bash
# Installs, from Debian's packages, whatever expert-arena needs to build and test.
# Idempotent: packages already present are left alone; nothing is fetched otherwise.
set -euo pipefail

required=(
  build-essential cmake ninja-build pkg-config python3
  liburing-dev libspdlog-dev libfmt-dev libcli11-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libxxhash-dev libsimdjson-dev libssl-dev
  libseccomp-dev  # tools/kernel-profile: older kernels and container runtimes emulated in tests
  clang libclang-rt-14-dev  # the libFuzzer build of tests/fuzz (clang 14 and its runtime)
  python3-dev pybind11-dev python3-numpy python3-torch python3-pytest  # the Python package
  python3-setuptools python3-wheel python3-pip  # pip install --no-build-isolation .
  libucx-dev ucx-utils iproute2  # across hosts (src/remote): UCX, ucx_perftest, test namespaces
  systemd python3-yaml  # deploy/'s examples: systemd-analyze verify, the Kubernetes manifests
)
# HIP host code compiles against Debian's ROCm packages; the CUDA toolkit lives at
# /usr/local/cuda and is not a Debian package here.
optional=(libamdhip64-dev hipcc
  gnuplot-nox)  # bench/*.sh plots (the benchmarks write their tables without it)

missing=()
for pkg in "${required[@]}" "${optional[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
    missing+=("$pkg")
done
# node and npm install the llama.cpp peer (scripts/llamacpp-peer.sh) for tests/llamacpp and
# bench/llamacpp_side_by_side.sh; a node already on PATH (e.g. NodeSource's, which bundles
# npm) is kept.
if ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; then
  missing+=(nodejs npm)
fi

if ((${#missing[@]} == 0)); then
  echo "install-deps: everything is installed"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
