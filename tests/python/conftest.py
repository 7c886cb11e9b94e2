"""Fixtures of the expert_arena package tests (pytest, Debian's python3-pytest).

Run by scripts/test.sh after the default build:

    PYTHONPATH=build/python /usr/bin/python3 -m pytest tests/python

The package comes from PYTHONPATH (build/python by default); the tools from
EXPERT_ARENA_BIN_DIR (default build/bin). A package that does not import fails the run in CI
(CI=true) and skips it elsewhere, with the reason.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("EXPERT_ARENA_BUILD_DIR", os.path.join(ROOT, "build"))
BIN = os.environ.get("EXPERT_ARENA_BIN_DIR", os.path.join(BUILD, "bin"))
if os.path.join(BUILD, "python") not in sys.path and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, os.path.join(BUILD, "python"))

IN_CI = os.environ.get("CI") == "true"

try:
    import expert_arena  # noqa: F401
    IMPORT_ERROR = None
except ImportError as e:  # the module was not built, or built for another interpreter
    IMPORT_ERROR = e


def pytest_collection_modifyitems(config, items):
    if IMPORT_ERROR is None:
        return
    why = "expert_arena does not import (%s); build it (EXPERT_ARENA_PYTHON=ON)" % IMPORT_ERROR
    if IN_CI:
        raise pytest.UsageError("CI: " + why)
    for item in items:
        item.add_marker(pytest.mark.skip(reason=why))


def tool(name):
    path = os.path.join(BIN, name)
    if not os.access(path, os.X_OK):
        if IN_CI:
            pytest.fail("%s is not built (cmake --build --preset default)" % path)
        pytest.skip("%s is not built" % path)
    return path


def child_env():
    """The environment for Python children: the same package on their path."""
    env = dict(os.environ)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(expert_arena.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (package_root, env.get("PYTHONPATH", "")) if p)
    return env


def test_dir():
    """Where arena files and stream segments go: $EXPERT_ARENA_TEST_DIR (a tmpfs mounted
    huge=always or a hugetlbfs, tests/kernel/kernel_profiles.sh), else /dev/shm."""
    return os.environ.get("EXPERT_ARENA_TEST_DIR") or "/dev/shm"


@pytest.fixture
def shm_path():
    """A unique arena path in the test directory (/dev/shm), removed afterwards."""
    made = []

    def make(stem="py"):
        p = os.path.join(test_dir(), "ea-pytest-%s-%s.arena" % (stem, uuid.uuid4().hex[:10]))
        made.append(p)
        return p

    yield make
    for p in made:
        if os.path.exists(p):
            os.unlink(p)


@pytest.fixture
def stream_dir():
    """A private directory in the test directory (/dev/shm) for stream segments (sweeps see
    only ours)."""
    d = tempfile.mkdtemp(prefix="ea-pytest-stream-", dir=test_dir())
    yield d
    shutil.rmtree(d, ignore_errors=True)


_MODELS = {}


@pytest.fixture(scope="session")
def model_dir():
    d = tempfile.mkdtemp(prefix="ea-pytest-models-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def gen_model(model_dir):
    """gen_model(fmt, dtype, layers=2, experts=4, hidden=64, ffn=96) -> path (cached)."""

    def make(fmt="gguf", dtype="f32", layers=2, experts=4, hidden=64, ffn=96):
        key = (fmt, dtype, layers, experts, hidden, ffn)
        if key not in _MODELS:
            ext = "gguf" if fmt == "gguf" else "safetensors"
            path = os.path.join(model_dir, "m-%s-%s-%d-%d-%d-%d.%s" % (fmt, dtype, *key[2:], ext))
            subprocess.run([tool("expert-arena"), "gen-model", "--format", fmt, "--out", path,
                            "--layers", str(layers), "--experts", str(experts),
                            "--hidden", str(hidden), "--ffn", str(ffn), "--dtype", dtype],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            _MODELS[key] = path
        return _MODELS[key]

    return make


def arena_table(path):
    """`expert-arena info --json PATH`: the tensor table with source paths and offsets."""
    out = subprocess.run([tool("expert-arena"), "info", "--json", path], check=True,
                         stdout=subprocess.PIPE).stdout
    return json.loads(out)


# The streaming peers, one protocol (see stream_roles.py): "py" the package's roles, "cxx"
# the C++ library's (python_peer), "c" the C interface's (capi_stream_c_program).
ROLES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stream_roles.py")


def peer_command(kind, role, directory):
    return {"c": [tool("capi_stream_c_program"), role, directory],
            "cxx": [tool("python_peer"), role, directory],
            "py": [sys.executable, ROLES, role, directory]}[kind]


def start_producer(kind, directory):
    """Starts a producer peer; returns (process, rows) once it printed "ready"."""
    p = subprocess.Popen(peer_command(kind, "produce", directory), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=child_env())
    rows = []
    for line in p.stdout:
        if line.strip() == "ready":
            return p, rows
        rows.append(line.split())
    p.wait(30)
    raise AssertionError("%s producer exited with %s before it was ready" % (kind, p.returncode))


def consume(kind, directory, descriptors):
    """Runs a consumer peer over descriptor hex lines; returns its rows."""
    out = subprocess.run(peer_command(kind, "consume", directory),
                         input="".join(d + "\n" for d in descriptors), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=child_env(),
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return [line.split() for line in out.stdout.splitlines()]


def arena_pss_kib(pid, path):
    """Pss of every mapping of the arena file in process `pid`, in KiB."""
    total, inside = 0, False
    with open("/proc/%d/smaps" % pid) as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not line.startswith(("Pss", "Rss")):
                inside = line.rstrip("\n").endswith(path)
            elif inside and line.startswith("Pss:"):
                total += int(line.split()[1])
    return total
