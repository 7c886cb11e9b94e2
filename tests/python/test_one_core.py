"""One core per process (docs/building.md, "How the pieces link"): a Python process that streams
across hosts (a listening producer over loopback and a consumer that fetches its tensor through
the UCX transport plugin) maps one libexpert_arena.so, and the module and the plugin reach the
same fork registry, pin budget and kernel-feature probe in it."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import IN_CI, child_env, test_dir as _test_dir

expert_arena = pytest.importorskip("expert_arena")

# Run in a fresh interpreter, so that what /proc/self/maps shows is this stream's doing only.
SCRIPT = r"""
import json, os, sys
import numpy as np
import expert_arena

def mapped():
    # Our objects' mappings, each object's .bss (the anonymous mapping right after its last
    # one) included.
    libs, last = {}, None
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if len(parts) < 6:
                if last is not None and libs[last]["ranges"][-1][1] == lo:
                    libs[last]["ranges"].append([lo, hi])
                last = None
                continue
            last = None
            name = os.path.basename(parts[5])
            if name.startswith("libexpert_arena") or name.startswith("_core"):
                libs.setdefault(parts[5], {"inode": parts[4], "ranges": []})["ranges"].append(
                    [lo, hi])
                last = parts[5]
    return libs

producer_dir, consumer_dir = sys.argv[1:3]
seen = {"import": mapped()}
with expert_arena.StreamProducer(producer_dir, "oc", segment_bytes=8 << 20, max_segments=2,
                                 quiet=True, listen="127.0.0.1:0", listen_token="t0k") as p, \
        expert_arena.StreamConsumer(consumer_dir, quiet=True, remote_token="t0k") as c:
    d = p.put("x", np.arange(4096, dtype=np.float32))
    assert expert_arena.decode_descriptor(d)["remote"] == p.remote_address
    with c.open(d) as t:
        assert float(t.numpy()[4095]) == 4095.0
        seen["streaming"] = mapped()
        seen["module"] = expert_arena._core._core_identity()
        seen["plugin"] = expert_arena._core._core_identity(plugin=True)
print(json.dumps(seen))
"""


def _run(tmp):
    producer_dir = os.path.join(tmp, "producer")
    consumer_dir = os.path.join(tmp, "consumer")
    os.mkdir(producer_dir)
    os.mkdir(consumer_dir)
    env = dict(child_env(), UCX_TLS="tcp")
    out = subprocess.run([sys.executable, "-c", SCRIPT, producer_dir, consumer_dir], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=120)
    if out.returncode != 0 and "without UCX" in out.stderr and not IN_CI:
        pytest.skip("built without UCX (libucx-dev)")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_process_streaming_across_hosts_holds_one_core():
    tmp = tempfile.mkdtemp(prefix="ea-pytest-onecore-", dir=_test_dir())
    try:
        seen = _run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    streaming = seen["streaming"]
    cores = {p: m for p, m in streaming.items()
             if os.path.basename(p).startswith("libexpert_arena.so")}
    plugins = [p for p in streaming if os.path.basename(p) == "libexpert_arena_ucx.so"]
    # The tensor came through the plugin: it is loaded, beside exactly one core.
    assert len(plugins) == 1, sorted(streaming)
    assert len(cores) == 1, sorted(streaming)
    assert len({m["inode"] for m in cores.values()}) == 1
    (core_path, core_map), = cores.items()
    module = expert_arena._core.__file__
    # The core is the library beside the module (the wheel's and build/python's layout).
    assert os.path.dirname(core_path) == os.path.dirname(os.path.realpath(module)), core_path
    # Importing mapped the same core; streaming mapped no second one.
    assert [p for p in seen["import"] if os.path.basename(p).startswith("libexpert_arena.so")] \
        == [core_path]

    mine, plugins_view = seen["module"], seen["plugin"]
    for key in ("fork_registry", "pin_budget", "kernel_features"):
        assert mine[key] != 0, (key, mine)
        assert mine[key] == plugins_view[key], (key, mine, plugins_view)
    # Both answers came from the code of that one library, whose data holds the pin budget.
    assert os.path.realpath(mine["object"]) == os.path.realpath(core_path), mine
    assert os.path.realpath(plugins_view["object"]) == os.path.realpath(core_path), plugins_view
    assert any(lo <= mine["pin_budget"] < hi for lo, hi in core_map["ranges"]), (mine, core_map)


def test_the_module_links_the_library_beside_it():
    module = expert_arena._core.__file__
    out = subprocess.run(["readelf", "-d", module], stdout=subprocess.PIPE, text=True,
                         check=True).stdout
    needed = [l.split("[")[1].rstrip("]") for l in out.splitlines() if "(NEEDED)" in l]
    runpath = [l.split("[")[1].rstrip("]") for l in out.splitlines() if "(RUNPATH)" in l]
    cores = [n for n in needed if n.startswith("libexpert_arena.so.")]
    assert len(cores) == 1, needed
    assert runpath == ["$ORIGIN"], runpath
    assert os.path.exists(os.path.join(os.path.dirname(module), cores[0]))
