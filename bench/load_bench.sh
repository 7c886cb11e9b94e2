#!/bin/sh
# The loader benchmark of docs/loader.md: makes a ~4 GiB synthetic MoE
# model (Qwen3-30B-A3B-shaped layers: hidden 2048, expert ffn 768, 16 experts, 28 layers, bf16)
# with gen-model, runs build/bin/load_bench on it (warm: vs memcpy and cp; cold: vs dd
# iflag=direct, which needs root for drop_caches), and deletes the model. Holds the machine-wide
# benchmark lock so two benchmarks never run at once.
#
#   bench/load_bench.sh [--dir DIR (default /tmp; not /dev/shm)] [--format gguf|safetensors]
#                       [--build-dir build] [load_bench options...]
set -eu
dir=/tmp
format=gguf
build=build
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --format) format=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    *) break ;;
  esac
done
case "$dir" in /dev/shm*) echo "load_bench.sh: the model must not live on /dev/shm" >&2; exit 2 ;; esac
ext=$format; [ "$format" = safetensors ] || ext=gguf
model="$dir/ea-load-bench-$$.$ext"
trap 'rm -f "$model"' EXIT INT TERM
exec 9>/tmp/expert-arena-bench.lock
flock 9
"$build/bin/expert-arena" gen-model --format "$format" --out "$model" --layers 28 --experts 16 \
  --hidden 2048 --ffn 768 --dtype bf16
"$build/bin/load_bench" --model "$model" --runs 3 "$@"
