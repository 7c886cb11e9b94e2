#!/usr/bin/env bash
# no_ucx_needed.sh [--plugin PLUGIN] FILE...
# Each FILE (the library, the tools, a test, the Python module) must have no DT_NEEDED on a UCX
# library (libucp, libucs, libucm, libuct): UCX is loaded only through the transport plugin
# (src/remote/ucx_plugin.h). PLUGIN must need libucp and export one symbol, its entry point.
set -euo pipefail
plugin=""
if [[ ${1:-} == --plugin ]]; then
  plugin=$2
  shift 2
fi
status=0
for f in "$@"; do
  needed=$(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  ucx=$(grep -E '^libuc[pstm]\.' <<<"$needed" || true)
  if [[ -n $ucx ]]; then
    echo "FAIL: $f needs $(tr '\n' ' ' <<<"$ucx")(UCX belongs in the plugin only)"
    status=1
  else
    echo "ok: $f needs no UCX library"
  fi
done
if [[ -n $plugin ]]; then
  if ! readelf -d "$plugin" | grep -q '(NEEDED).*\[libucp\.'; then
    echo "FAIL: $plugin does not need libucp"
    status=1
  fi
  exported=$(readelf --dyn-syms -W "$plugin" |
    awk '$1 ~ /^[0-9]+:$/ && $5 != "LOCAL" && $7 != "UND" && $4 != "SECTION" && $4 != "FILE" && NF >= 8 {print $8}' |
    grep -v '^EXPERT_ARENA_UCX_1$' | sort -u)
  if [[ $exported != "expert_arena_ucx_v1@@EXPERT_ARENA_UCX_1" ]]; then
    echo "FAIL: $plugin exports more than its entry point: $(tr '\n' ' ' <<<"$exported")"
    status=1
  else
    echo "ok: $plugin needs libucp and exports only expert_arena_ucx_v1"
  fi
fi
exit $status
