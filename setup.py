"""pip install of the Python package expert_arena: builds python/ with the project's CMake.

    pip install --no-build-isolation .        (offline: setuptools, wheel and pip from Debian)

The extension module is CMake's target expert_arena_python (build directory build-pip/, kept
between installs), with libexpert_arena.so.N (the core it links) and the UCX transport plugin
libexpert_arena_ucx.so next to it when UCX is found; extra CMake options come from the CMAKE_ARGS environment variable, e.g.
CMAKE_ARGS="-DEXPERT_ARENA_CUDA=ON -DCMAKE_CXX_COMPILER_LAUNCHER=ccache". See docs/python.md.
"""

import os
import re
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        m = re.search(r"project\(expert_arena VERSION (\d+\.\d+\.\d+)", f.read())
    if not m:
        sys.exit("setup.py: no project(expert_arena VERSION x.y.z) in CMakeLists.txt")
    return m.group(1)


class CMakeExtension(Extension):
    def __init__(self, name):
        super().__init__(name, sources=[])


def reusable_build_dir(ext_filename):
    """The project's own build directory (EXPERT_ARENA_BUILD_DIR, default build/) when it was
    configured with the Python module and its module is built for this interpreter's ABI (the
    same extension suffix: a .venv made from the interpreter build/ was configured for), so a
    pip install rebuilds nothing that is already built; None otherwise."""
    build_dir = os.environ.get("EXPERT_ARENA_BUILD_DIR", os.path.join(ROOT, "build"))
    cache = os.path.join(build_dir, "CMakeCache.txt")
    if not os.path.exists(cache):
        return None
    with open(cache) as f:
        if not any(re.match(r"EXPERT_ARENA_PYTHON:[A-Z]+=ON$", line.strip()) for line in f):
            return None
    module = os.path.join(build_dir, "python", "expert_arena", os.path.basename(ext_filename))
    return build_dir if os.path.exists(module) else None


class CMakeBuild(build_ext):
    """Builds the module with CMake, then copies it where setuptools wants it: in the project's
    build directory when it has this interpreter's module (only the module's target is brought
    up to date there), else in build-pip/ (configured for the module only)."""

    def build_extension(self, ext):
        reused = reusable_build_dir(self.get_ext_filename(ext.name))
        if reused and "EXPERT_ARENA_PIP_BUILD_DIR" not in os.environ:
            print("expert_arena: reusing the build in %s (target expert_arena_python)" % reused)
            jobs = os.environ.get("EXPERT_ARENA_JOBS", str(min(4, os.cpu_count() or 1)))
            subprocess.check_call(["cmake", "--build", reused, "-j", jobs,
                                   "--target", "expert_arena_python"])
            self.copy_module(reused, ext)
            return
        build_dir = os.environ.get("EXPERT_ARENA_PIP_BUILD_DIR", os.path.join(ROOT, "build-pip"))
        configure = ["cmake", "-S", ROOT, "-B", build_dir,
                     "-DCMAKE_BUILD_TYPE=" + os.environ.get("CMAKE_BUILD_TYPE", "RelWithDebInfo"),
                     "-DEXPERT_ARENA_PYTHON=ON", "-DEXPERT_ARENA_BUILD_TESTS=OFF",
                     "-DEXPERT_ARENA_BUILD_BENCH=OFF", "-DPython3_EXECUTABLE=" + sys.executable]
        if shutil.which("ninja"):
            configure += ["-G", "Ninja"]
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        if os.path.exists(os.path.join(build_dir, "CMakeCache.txt")):
            configure = [a for a in configure if a not in ("-G", "Ninja")]
        subprocess.check_call(configure)
        jobs = os.environ.get("EXPERT_ARENA_JOBS", str(min(4, os.cpu_count() or 1)))
        subprocess.check_call(["cmake", "--build", build_dir, "-j", jobs,
                               "--target", "expert_arena_python"])
        self.copy_module(build_dir, ext)

    def copy_module(self, build_dir, ext):
        built = os.path.join(build_dir, "python", "expert_arena",
                             os.path.basename(self.get_ext_filename(ext.name)))
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(built, target)
        # libexpert_arena.so under its soname: the module links it and finds it beside itself
        # (RUNPATH $ORIGIN); the process's one copy of the core.
        for name in os.listdir(os.path.dirname(built)):
            if name.startswith("libexpert_arena.so."):
                shutil.copyfile(os.path.join(os.path.dirname(built), name),
                                os.path.join(os.path.dirname(target), name))
        # The UCX transport plugin (built with the module when UCX is found): the module
        # loads it from its own directory at the first open(..., from_peer=...).
        plugin = os.path.join(os.path.dirname(built), "libexpert_arena_ucx.so")
        if os.path.exists(plugin):
            shutil.copyfile(plugin, os.path.join(os.path.dirname(target),
                                                 "libexpert_arena_ucx.so"))
        # The network process a listening StreamProducer runs its UCX side in, beside the
        # plugin (copy2: it must stay executable).
        net = os.path.join(os.path.dirname(built), "expert-arena-net")
        if os.path.exists(net):
            shutil.copy2(net, os.path.join(os.path.dirname(target), "expert-arena-net"))


setup(
    name="expert_arena",
    version=project_version(),
    description="Shared MoE expert arenas and zero-copy tensor streaming for NumPy and PyTorch",
    license="See the project's repository",
    python_requires=">=3.9",
    install_requires=["numpy"],
    extras_require={"torch": ["torch"]},
    packages=["expert_arena"],
    package_dir={"": "python"},
    package_data={"expert_arena": ["__init__.pyi", "py.typed"]},
    ext_modules=[CMakeExtension("expert_arena._core")],
    # vLLM loads its general plugins in every process it starts: --load-format expert_arena.
    entry_points={"vllm.general_plugins": ["expert_arena = expert_arena.vllm:register"]},
    cmdclass={"build_ext": CMakeBuild},
    zip_safe=False,
)
