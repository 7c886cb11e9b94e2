"""`cmake --install` puts an importable package under the prefix's site directory."""

import filecmp
import os
import subprocess
import sys

import pytest

from conftest import BUILD


# Prints each libexpert_arena.so the process has mapped (one line each).
PRINT_CORES = ("print('\\n'.join(sorted({l.split()[-1] for l in open('/proc/self/maps')\n"
               "                           if '/libexpert_arena.so' in l})))\n")


def test_cmake_install_gives_an_importable_package(tmp_path, gen_model):
    if not os.path.exists(os.path.join(BUILD, "CMakeCache.txt")):
        pytest.skip("no CMake build directory at %s" % BUILD)
    subprocess.run(["cmake", "--install", BUILD, "--component", "python", "--prefix",
                    str(tmp_path)], check=True, stdout=subprocess.DEVNULL)
    sites = [os.path.join(root) for root, dirs, _ in os.walk(tmp_path) if "expert_arena" in dirs]
    assert len(sites) == 1, sites
    site = sites[0]
    assert site.endswith(("dist-packages", "site-packages"))
    files = set(os.listdir(os.path.join(site, "expert_arena")))
    assert {"__init__.py", "__init__.pyi", "__main__.py", "py.typed"} <= files
    assert any(f.startswith("_core.") and f.endswith(".so") for f in files)
    # The core the module links lies beside it (docs/building.md, "How the pieces link").
    assert any(f.startswith("libexpert_arena.so.") for f in files), files
    script = ("import sys, expert_arena\n"
              "assert expert_arena.__file__.startswith(sys.argv[1]), expert_arena.__file__\n"
              "a = expert_arena.open(sys.argv[2], quiet=True)\n"
              "print(a.report['role'], len(a))\n" + PRINT_CORES)
    env = dict(os.environ, PYTHONPATH=site)
    out = subprocess.run([sys.executable, "-c", script, site, gen_model("gguf", "f32")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=str(tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[:2] == ["private", "6"]
    assert out.stdout.split()[2:] == [
        os.path.realpath(os.path.join(site, "expert_arena", "libexpert_arena.so.0"))]


def test_cmake_install_carries_the_ucx_plugin(tmp_path, gen_model, shm_path):
    """The transport plugin is installed next to the module, and the installed module loads
    it from there (a fill from a peer that is not listening then fails in UCX, not earlier)."""
    cache = os.path.join(BUILD, "CMakeCache.txt")
    if not os.path.exists(cache):
        pytest.skip("no CMake build directory at %s" % BUILD)
    with open(cache) as f:
        if not any(line.startswith("UCX_FOUND:INTERNAL=1") for line in f):
            pytest.skip("built without UCX (libucx-dev)")
    subprocess.run(["cmake", "--install", BUILD, "--component", "python", "--prefix",
                    str(tmp_path)], check=True, stdout=subprocess.DEVNULL)
    sites = [root for root, dirs, _ in os.walk(tmp_path) if "expert_arena" in dirs]
    assert len(sites) == 1, sites
    assert os.path.exists(os.path.join(sites[0], "expert_arena", "libexpert_arena_ucx.so"))
    # The network process a listening StreamProducer runs, beside it and executable.
    assert os.access(os.path.join(sites[0], "expert_arena", "expert-arena-net"), os.X_OK)
    script = ("import sys, tempfile, expert_arena\n"
              "assert expert_arena.__file__.startswith(sys.argv[1]), expert_arena.__file__\n"
              "a = expert_arena.open(sys.argv[2], shared_path=sys.argv[3],\n"
              "                      from_peer='127.0.0.1:9', quiet=True)\n"
              "print(a.report['peer_note'])\n"
              "d = tempfile.mkdtemp(prefix='ea-pytest-net-', dir='/dev/shm')\n"
              "with expert_arena.StreamProducer(d, 'net', segment_bytes=8 << 20, max_segments=1,\n"
              "                                 quiet=True, listen='127.0.0.1:0') as p:\n"
              "    print('listening', p.remote_address)\n"
              "import shutil; shutil.rmtree(d)\n")
    env = dict(os.environ, PYTHONPATH=sites[0])
    env.pop("EXPERT_ARENA_UCX_PLUGIN", None)
    out = subprocess.run([sys.executable, "-c", script, sites[0], gen_model("gguf", "f32"),
                          shm_path("installed")], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=str(tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
    assert "read the model files instead" in out.stdout
    assert "UCX transport plugin" not in out.stdout, out.stdout
    assert "listening 127.0.0.1:" in out.stdout, out.stdout + out.stderr


def test_pip_install_into_a_venv_reuses_the_build(tmp_path, gen_model):
    """`pip install .` into a virtual environment made from this interpreter's base (as
    scripts/install-deps.sh makes .venv) takes the module of the project's build directory
    (nothing rebuilt from scratch), and the installed package loads an arena there."""
    from conftest import ROOT
    if not os.path.exists(os.path.join(BUILD, "CMakeCache.txt")):
        pytest.skip("no CMake build directory at %s" % BUILD)
    had_pip_build = os.path.exists(os.path.join(ROOT, "build-pip"))
    venv = tmp_path / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--system-site-packages", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["EXPERT_ARENA_BUILD_DIR"] = BUILD
    out = subprocess.run([python, "-m", "pip", "install", "-v", "--no-build-isolation",
                          "--no-deps", "--no-index", ROOT], env=env, capture_output=True,
                         text=True, timeout=600, cwd=str(tmp_path))
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    # Reused: the installed module is the build directory's file, and no build-pip/ was made
    # (pip may not show the backend's own output).
    assert not os.path.exists(os.path.join(ROOT, "build-pip")) or had_pip_build
    installed = subprocess.run(
        [python, "-c", "import expert_arena._core as c; print(c.__file__)"], env=env,
        capture_output=True, text=True, cwd=str(tmp_path), timeout=60)
    assert installed.returncode == 0, installed.stderr
    module = installed.stdout.strip()
    assert module.startswith(str(venv)), module
    assert filecmp.cmp(module, os.path.join(BUILD, "python", "expert_arena",
                                            os.path.basename(module)), shallow=False)
    script = ("import sys, expert_arena\n"
              "assert expert_arena.__file__.startswith(sys.prefix), expert_arena.__file__\n"
              "a = expert_arena.open(sys.argv[1], quiet=True)\n"
              "print(a.report['role'], len(a))\n" + PRINT_CORES)
    run = subprocess.run([python, "-c", script, gen_model("gguf", "f32")], env=env,
                         capture_output=True, text=True, cwd=str(tmp_path), timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split()[:2] == ["private", "6"]
    # The wheel's own copy of the core, beside the module: nothing of build/ is loaded.
    assert run.stdout.split()[2:] == [os.path.realpath(
        os.path.join(os.path.dirname(module), "libexpert_arena.so.0"))], run.stdout
