"""expert_arena.metrics(): the exposition `expert-arena metrics` prints, from inside an engine."""

import logging
import os
import shutil
import subprocess

import numpy as np
import pytest

import expert_arena
from conftest import IN_CI, tool


def samples(text):
    """{(name, labels text): value} of an exposition."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, value = line.rsplit(" ", 1)
        name, _, labels = key.partition("{")
        out[(name, labels.rstrip("}"))] = float(value)
    return out


def value(text, name, **labels):
    for (n, l), v in samples(text).items():
        if n == name and all('%s="%s"' % kv in l for kv in labels.items()):
            return v
    raise AssertionError("no %s%s in\n%s" % (name, labels, text))


def test_metrics_are_those_of_the_cli_and_promtool_accepts_them(gen_model, stream_dir):
    model = gen_model("gguf", "f16")
    arena = os.path.join(stream_dir, "m.arena")
    with expert_arena.open(model, shared_path=arena, quiet=True) as a, \
            expert_arena.StreamProducer(stream_dir, "kv", segment_bytes=2 << 20,
                                        max_segments=2) as p:
        p.put("t0", np.arange(1000, dtype=np.float32))
        text = expert_arena.metrics(stream_dir)
        cli = subprocess.run([tool("expert-arena"), "metrics", stream_dir], check=True,
                             stdout=subprocess.PIPE, text=True).stdout
        # The same numbers as the command operators run, from the same state; but the free
        # bytes of the filesystem, which any other process on the host changes between the two
        # reads (the ThreadSanitizer tests run beside this suite in CI).
        live = "expert_arena_filesystem_avail_bytes{"

        def steady(t):
            return [line for line in t.splitlines() if not line.startswith(live)]
        assert steady(text) == steady(cli)
        assert value(text, "expert_arena_filesystem_avail_bytes") > 0
        assert value(cli, "expert_arena_filesystem_avail_bytes") > 0
        assert value(text, "expert_arena_arena_bytes", path=arena) == os.path.getsize(arena)
        assert value(text, "expert_arena_arena_in_use", path=arena, state="published") == 1
        assert value(text, "expert_arena_arena_users", path=arena) >= 1
        assert value(text, "expert_arena_arena_info", path=arena,
                     identity_hash="%016x" % a.report["identity_hash"]) == 1
        assert value(text, "expert_arena_segment_owner_alive", stream="kv") == 1
        assert value(text, "expert_arena_segment_live_blocks", stream="kv") == 1
        assert value(text, "expert_arena_reclaimable_bytes", command="rm") == 0
        promtool = shutil.which("promtool")
        if promtool is None:
            if IN_CI:
                pytest.fail("promtool is missing (Debian package prometheus)")
        else:
            check = subprocess.run([promtool, "check", "metrics"], input=text, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            assert check.returncode == 0, check.stdout
    # Closed: nobody maps the arena, and rm would free it.
    text = expert_arena.metrics([stream_dir])
    assert value(text, "expert_arena_arena_in_use", path=arena) == 0
    assert value(text, "expert_arena_reclaimable_bytes", command="rm") == os.path.getsize(arena)


def test_a_missing_directory_is_down_with_a_warning(stream_dir, caplog):
    missing = os.path.join(stream_dir, "no-such-dir")
    with caplog.at_level(logging.WARNING, logger="expert_arena"):
        text = expert_arena.metrics([missing, stream_dir])
    assert value(text, "expert_arena_directory_up", directory=missing) == 0
    assert value(text, "expert_arena_directory_up", directory=stream_dir) == 1
    assert any(missing in r.getMessage() and "does not exist" in r.getMessage()
               for r in caplog.records), caplog.text
