#!/usr/bin/env bash
# systemd_recipe_test.sh SOURCE_DIR BUILD_DIR
#
# The bare-metal recipe of docs/deployment.md, run as the document gives it: the first command
# block of "## Bare metal (systemd)", line by line, from the source tree, all but `sysctl` and
# `systemctl` (they change the running host, and there may be no systemd running here). It runs
# in a mount namespace of its own whose /etc, /usr/local and /dev are overlays thrown away at
# the end (useradd, mkdir, cp and install land there), with a small tmpfs standing in for the
# hugetlbfs at /dev/hugepages. The block's `systemd-analyze verify` must exit 0 and print
# nothing about our units. Then the installed unit's ExecStartPre= runs as root and its
# ExecStart= as its User= (setpriv), with the instance's /etc/expert-arena/NAME.conf: the holder
# must load and hold the arena in the directory made for it, as that user.
#
# Needs root, unshare and overlayfs; exit 77 (a skip) without them, a failure in CI.
set -euo pipefail
src=$(cd "$1" && pwd)
build=$(cd "$2" && pwd)

skip() {
  if [[ ${CI:-} == true ]]; then
    echo "FAIL (in CI): $*"
    exit 1
  fi
  echo "SKIP: $*"
  exit 77
}
[[ $(id -u) -eq 0 ]] || skip "needs root (a mount namespace, useradd, setpriv)"
for tool in unshare setpriv systemd-analyze useradd; do
  command -v "$tool" >/dev/null || skip "$tool is missing"
done
[[ -x $build/bin/expert-arena ]] || skip "$build/bin/expert-arena is not built"

work=$(mktemp -d /tmp/ea-systemd-recipe.XXXXXX)
cleanup() { rm -rf "$work"; }
trap cleanup EXIT

# The blocks, as written; a build directory other than build/ stands in for build/.
# Every block of the section: the holder's, then the metrics timer's.
awk '/^## Bare metal \(systemd\)/ {in_section = 1; next}
     in_section && /^## / {exit}
     in_section && /^```/ {in_block = !in_block; next}
     in_block {print}' "$src/docs/deployment.md" >"$work/block.sh"
grep -q 'systemd-analyze verify' "$work/block.sh" || {
  echo "FAIL: the recipe gives no systemd-analyze verify command"
  cat "$work/block.sh"
  exit 1
}
if [[ $build != "$src/build" ]]; then
  sed -i "s|\bbuild/bin/|$build/bin/|g" "$work/block.sh"
fi

# A model the expert-arena user may read.
chmod 0755 "$work"
"$build/bin/expert-arena" gen-model --format gguf --out "$work/model.gguf" --layers 2 \
  --experts 2 --hidden 64 --ffn 64 >/dev/null
chmod 0644 "$work/model.gguf"

mkdir -p "$work"/{etc,usr-local,dev,var-lib}/{upper,work}
cat >"$work/inside.sh" <<EOF
set -euo pipefail
mount -t overlay overlay -o lowerdir=/etc,upperdir=$work/etc/upper,workdir=$work/etc/work /etc
mount -t overlay overlay \
  -o lowerdir=/usr/local,upperdir=$work/usr-local/upper,workdir=$work/usr-local/work /usr/local
mount -t overlay overlay -o lowerdir=/dev,upperdir=$work/dev/upper,workdir=$work/dev/work /dev
mount -t overlay overlay -o lowerdir=/var/lib,upperdir=$work/var-lib/upper,workdir=$work/var-lib/work /var/lib
mkdir -p /dev/hugepages
mount -t tmpfs -o size=64m,mode=0755 tmpfs /dev/hugepages
cd "$src"
while IFS= read -r line; do
  command=\${line%%#*}
  [[ -z \${command// } ]] && continue
  case \$command in
    sysctl*|systemctl*) echo "not run here: \$command"; continue ;;
  esac
  echo "+ \$command"
  if [[ \$command == systemd-analyze* ]]; then
    out=\$(eval "\$command" 2>&1) || { echo "FAIL: exit \$?: \$out"; exit 1; }
    if grep -i 'expert-arena' <<<"\$out"; then echo "FAIL: verify warns about our units"; exit 1; fi
  else
    eval "\$command"
  fi
done <"$work/block.sh"
[[ -x /usr/local/bin/expert-arena ]] || { echo "FAIL: the recipe installs no /usr/local/bin/expert-arena"; exit 1; }
[[ -f /etc/expert-arena/qwen3-30b.conf ]] || { echo "FAIL: no /etc/expert-arena/qwen3-30b.conf"; exit 1; }

# "then set MODEL=": the operator's edit of the instance's file.
sed -i "s|^MODEL=.*|MODEL=$work/model.gguf|" /etc/expert-arena/qwen3-30b.conf
unit=/etc/systemd/system/expert-arena-holder@.service
set -a
. /etc/expert-arena/qwen3-30b.conf
set +a
user=\$(sed -n 's/^User=//p' \$unit)
group=\$(sed -n 's/^Group=//p' \$unit)
pre=\$(sed -n 's/^ExecStartPre=+//p' \$unit)
start=\$(sed -n 's/^ExecStart=//p' \$unit)
[[ -n \$start && -n \$user ]] || { echo "FAIL: the unit lacks ExecStart= or User="; exit 1; }
if [[ -n \$pre ]]; then
  echo "+ (ExecStartPre, as root) \$pre"
  eval "\$pre"
fi
echo "+ (ExecStart, as \$user) \$start"
umask 0007
setpriv --reuid="\$user" --regid="\$group" --init-groups bash -c "exec \$start" </dev/null \
  >$work/holder.out 2>$work/holder.err &
holder=\$!
for _ in \$(seq 600); do
  grep -q '"role"' $work/holder.out 2>/dev/null && break
  kill -0 \$holder 2>/dev/null || break
  sleep 0.1
done
status=0
if grep -q '"role":"loaded"' $work/holder.out; then
  stat -c '%U %G %a %n' "\$ARENA" "\$(dirname "\$ARENA")"
  [[ \$(stat -c %U "\$ARENA") == "\$user" ]] || { echo "FAIL: the arena is not the user's"; status=1; }
  [[ \$(stat -c %a "\$ARENA") == 660 ]] || { echo "FAIL: the arena's mode is not 0660"; status=1; }
  /usr/local/bin/expert-arena ls "\$(dirname "\$ARENA")"
else
  echo "FAIL: the holder did not load the arena"
  status=1
fi
cat $work/holder.err
kill -TERM \$holder 2>/dev/null || true
rc=0
wait \$holder || rc=\$?
[[ \$rc -eq 0 ]] || { echo "FAIL: the holder exited \$rc on SIGTERM"; status=1; }

# The metrics timer's service, as installed: verified, then run once as root (node_exporter's
# package makes the textfile directory; made here when it is not installed).
metrics=/etc/systemd/system/expert-arena-metrics.service
[[ -f \$metrics && -f /etc/systemd/system/expert-arena-metrics.timer ]] ||
  { echo "FAIL: the recipe installs no metrics service and timer"; exit 1; }
out=\$(systemd-analyze verify \$metrics /etc/systemd/system/expert-arena-metrics.timer 2>&1) ||
  { echo "FAIL: verify of the metrics units: \$out"; status=1; }
if grep -i 'expert-arena' <<<"\$out"; then echo "FAIL: verify warns about the metrics units"; status=1; fi
mkdir -p /var/lib/prometheus/node-exporter
run=\$(sed -n 's/^ExecStart=//p' \$metrics)
echo "+ (metrics, as root) \$run"
eval "\$run" || { echo "FAIL: the metrics service's command failed"; status=1; }
prom=/var/lib/prometheus/node-exporter/expert_arena.prom
grep "expert_arena_arena_bytes{path=\"\$ARENA\"" \$prom ||
  { echo "FAIL: \$prom does not list \$ARENA"; status=1; }
if command -v promtool >/dev/null; then
  promtool check metrics <\$prom || { echo "FAIL: promtool check metrics"; status=1; }
fi
exit \$status
EOF
unshare --mount --propagation private bash "$work/inside.sh"
echo "ok: the recipe installs, verifies and runs as written"
