#!/bin/sh
# The scale benchmark of docs/scale.md: how attach time, load overhead and heap per engine grow
# with the model's metadata. Makes DeepSeek-V3-shaped safetensors models with gen-model
# (--layout deepseek-v3: 61 layers, FP8 + weight_scale_inv, tiny tensors so the metadata has
# its real size and the data is small), then for each:
#   tensor count: 3, 29, 128, 256, 512 experts -> 1,044 ... 178,176 selected tensors, 163 shards
#   shard count:  256 experts (89,088 tensors) in 1, 16 and 163 shards
#   arena size:   synthmoe bf16 models of 1, 4 and 8 GiB of expert data (16 GiB is not run by
#                 default: on a shared 24 GiB machine the arena plus the model's page cache
#                 would push others out; --sizes "1 4 8 16" asks for it)
# runs build/bin/scale_bench in a fresh process per measurement (load: best of 3; attach: 5
# runs, best and median) and writes OUT/scale.tsv and OUT/scale.png (gnuplot). Models live in
# DIR (not /dev/shm), the arena in /dev/shm; both are removed at the end. Holds the machine-wide
# benchmark lock.
#
#   bench/scale_bench.sh [--dir DIR (default /tmp)] [--out bench/results/DATE-vm]
#                        [--build-dir build] [--sizes "1 4 8"] [--quick]
#                        [--sweeps "tensors shards size"] (a subset appends to scale.tsv)
set -eu
dir=/tmp
out=bench/results/$(date -u +%Y-%m-%d)-vm
build=build
sizes="1 4 8"
experts="3 29 128 256 512"
shards="1 16 163"
sweeps="tensors shards size"
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) dir=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --build-dir) build=$2; shift 2 ;;
    --sizes) sizes=$2; shift 2 ;;
    --quick) experts="3 29"; shards="16"; sizes="1"; shift ;;
    --sweeps) sweeps=$2; shift 2 ;;
    *) echo "scale_bench.sh: unknown option $1" >&2; exit 2 ;;
  esac
done
case "$dir" in /dev/shm*) echo "scale_bench.sh: the models must not live on /dev/shm" >&2; exit 2 ;; esac
tool="$build/bin/expert-arena"
bench="$build/bin/scale_bench"
work="$dir/ea-scale-bench-$$"
arena="/dev/shm/ea-scale-bench-$$.arena"
trap 'rm -rf "$work"; rm -f "$arena"' EXIT INT TERM
exec 9>/tmp/expert-arena-bench.lock
flock 9
mkdir -p "$work" "$out"
tsv="$out/scale.tsv"
[ "$sweeps" = "tensors shards size" ] || [ ! -f "$tsv" ] || append=1
[ -n "${append:-}" ] || printf 'sweep\tx\ttensors\tshards\tdata_mib\tplan_s\tload_open_s\tload_overhead_s\tattach_best_ms\tattach_median_ms\theap_peak_mib\theap_retained_kib\trss_beyond_map_kib\tfind_ns\tbytes_read\n' >"$tsv"

field() { sed -n "s/.*\"$1\":\([0-9.e+-]*\).*/\1/p"; }

# measure SWEEP X MODEL SHARDS
measure() {
  sweep=$1 x=$2 model=$3 nshards=$4
  plan=$("$bench" plan --model "$model" --runs 3 | field seconds)
  best_open=""; best_over=""; data=0
  for i in 1 2 3; do
    line=$("$bench" load --model "$model" --arena "$arena" 2>/dev/null)
    o=$(echo "$line" | field open_seconds); v=$(echo "$line" | field overhead_seconds)
    data=$(echo "$line" | field data_bytes)
    if [ -z "$best_open" ] || [ "$(echo "$o < $best_open" | bc -l)" = 1 ]; then best_open=$o; best_over=$v; fi
  done
  times=""
  for i in 1 2 3 4 5; do
    line=$("$bench" attach --model "$model" --arena "$arena" 2>/dev/null)
    times="$times $(echo "$line" | field open_seconds)"
    last=$line
  done
  sorted=$(echo $times | tr ' ' '\n' | sort -g)
  best=$(echo "$sorted" | head -1); median=$(echo "$sorted" | sed -n 3p)
  tensors=$(echo "$last" | field tensors)
  printf '%s\t%s\t%s\t%s\t%.1f\t%.3f\t%.3f\t%.3f\t%.2f\t%.2f\t%.2f\t%.1f\t%.0f\t%s\t%s\n' \
    "$sweep" "$x" "$tensors" "$nshards" "$(echo "$data / 1048576" | bc -l)" "$plan" "$best_open" \
    "$best_over" "$(echo "$best * 1000" | bc -l)" "$(echo "$median * 1000" | bc -l)" \
    "$(echo "$(echo "$last" | field heap_peak) / 1048576" | bc -l)" \
    "$(echo "$(echo "$last" | field heap_retained) / 1024" | bc -l)" \
    "$(echo "$(echo "$last" | field rss_beyond_mapping) / 1024" | bc -l)" \
    "$(echo "$last" | field find_ns)" "$(echo "$last" | field bytes_read)" | tee -a "$tsv"
  rm -f "$arena"
}

case " $sweeps " in *" tensors "*) ;; *) experts="" ;; esac
case " $sweeps " in *" shards "*) ;; *) shards="" ;; esac
case " $sweeps " in *" size "*) ;; *) sizes="" ;; esac
for e in $experts; do
  m="$work/ds-e$e"
  "$tool" gen-model --format safetensors --layout deepseek-v3 --experts "$e" --shards 163 --out "$m" >/dev/null
  measure tensors "$e" "$m" 163
  rm -rf "$m"
done
for s in $shards; do
  m="$work/ds-s$s"
  "$tool" gen-model --format safetensors --layout deepseek-v3 --shards "$s" --out "$m" >/dev/null
  measure shards "$s" "$m" "$s"
  rm -rf "$m"
done
for g in $sizes; do
  # synthmoe bf16, one layer, hidden 4096, ffn 2048: 48 MiB of experts each; 21.3 per GiB.
  e=$(( g * 64 / 3 ))
  m="$work/big-$g.safetensors"
  "$tool" gen-model --format safetensors --out "$m" --layers 1 --experts "$e" --hidden 4096 \
    --ffn 2048 --dtype bf16 >/dev/null
  measure size "$g" "$m" 1
  rm -f "$m"
done

command -v gnuplot >/dev/null || { echo "scale_bench.sh: no gnuplot; $tsv written" >&2; exit 0; }
gnuplot <<PLOT
set terminal pngcairo size 1400,900 font ",10" noenhanced
set output "$out/scale.png"
set datafile separator "\t"
set multiplot layout 2,2 title "expert-arena scale_bench ($(date -u +%Y-%m-%d), $(nproc)-core VM): DeepSeek-V3-shaped safetensors (gen-model --layout deepseek-v3)"
set grid
set key top left
set logscale x
set xlabel "selected tensors (163 shards)"
set ylabel "ms"
set title "attach: Open() time"
plot "$tsv" using (strcol(1) eq "tensors" ? \$3 : NaN):9 with linespoints title "best of 5", \
     "" using (strcol(1) eq "tensors" ? \$3 : NaN):10 with linespoints title "median of 5"
set title "load: Open() time beyond moving the bytes"
set ylabel "s"
plot "$tsv" using (strcol(1) eq "tensors" ? \$3 : NaN):8 with linespoints title "load overhead", \
     "" using (strcol(1) eq "tensors" ? \$3 : NaN):6 with linespoints title "of which plan"
set title "heap per attaching engine"
set ylabel "MiB / KiB"
plot "$tsv" using (strcol(1) eq "tensors" ? \$3 : NaN):11 with linespoints title "peak heap (MiB)", \
     "" using (strcol(1) eq "tensors" ? \$3 : NaN):(\$12/1024) with linespoints title "retained heap (MiB)"
unset logscale x
set title "attach vs arena size (1 shard) and vs shard count (89,088 tensors)"
set xlabel "GiB of data / shards"
set ylabel "ms"
plot "$tsv" using (strcol(1) eq "size" ? \$2 : NaN):9 with linespoints title "attach best, by GiB", \
     "" using (strcol(1) eq "shards" ? \$2 : NaN):9 with linespoints title "attach best, by shards"
unset multiplot
PLOT
echo "wrote $tsv and $out/scale.png"
