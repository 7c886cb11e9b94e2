"""The deployment examples under deploy/ (docs/deployment.md) are checked, not just shown:
the systemd unit passes `systemd-analyze verify` with no warning, the Kubernetes manifests parse
and hold what the document says (a DaemonSet holder requesting hugepages-2Mi, engines on the
same hostPath), the docker script parses, and every expert-arena / moe-engine flag they use is
one the built tools accept."""

import os
import re
import shutil
import subprocess

import pytest

from conftest import IN_CI, ROOT, tool

DEPLOY = os.path.join(ROOT, "deploy")


def need(program, package):
    path = shutil.which(program)
    if path is None:
        if IN_CI:
            pytest.fail("%s is missing (Debian package %s, scripts/install-deps.sh)"
                        % (program, package))
        pytest.skip("%s is missing (Debian package %s)" % (program, package))
    return path


def test_systemd_holder_unit_verifies(tmp_path):
    analyze = need("systemd-analyze", "systemd")
    # verify checks that ExecStart's program exists: point it at the built tool.
    unit = open(os.path.join(DEPLOY, "systemd", "expert-arena-holder@.service")).read()
    assert "--hold" in unit and "expert-arena load" in unit
    unit = unit.replace("/usr/local/bin/expert-arena", os.path.abspath(tool("expert-arena")))
    (tmp_path / "expert-arena-holder@.service").write_text(unit)
    shutil.copy(os.path.join(DEPLOY, "systemd", "expert-arena.slice"), tmp_path)
    r = subprocess.run([analyze, "verify", "expert-arena-holder@test.service",
                        "expert-arena.slice"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    # Unknown keys and bad values are warnings with exit 0: none may be printed for our files.
    ours = [line for line in (r.stdout + r.stderr).splitlines()
            if "expert-arena" in line]
    assert r.returncode == 0 and not ours, r.stdout + r.stderr


def manifests():
    yaml = pytest.importorskip("yaml") if not IN_CI else __import__("yaml")
    docs = {}
    for name in ("holder-daemonset.yaml", "engine-pod.yaml"):
        with open(os.path.join(DEPLOY, "kubernetes", name)) as f:
            docs[name] = yaml.safe_load(f)
    return docs


def test_kubernetes_holder_and_engine_share_a_hostpath_with_hugepages():
    docs = manifests()
    holder = docs["holder-daemonset.yaml"]
    engine = docs["engine-pod.yaml"]
    assert holder["kind"] == "DaemonSet"
    hspec = holder["spec"]["template"]["spec"]
    hc = hspec["containers"][0]
    assert hc["command"][:2] == ["expert-arena", "load"] and "--hold" in hc["command"]
    # The holder pays for the arena's huge pages: requests and limits name them, equal.
    assert hc["resources"]["limits"]["hugepages-2Mi"] == hc["resources"]["requests"][
        "hugepages-2Mi"]
    assert engine["kind"] == "Pod"
    ec = engine["spec"]["containers"][0]
    assert "hugepages-2Mi" not in ec["resources"].get("limits", {}), "attaching is not charged"

    def arena_host_path(spec, container):
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        for v in spec["volumes"]:
            if "hostPath" in v and mounts.get(v["name"]) == "/arenas":
                return v["hostPath"]["path"]
        return None

    assert arena_host_path(hspec, hc) is not None
    assert arena_host_path(hspec, hc) == arena_host_path(engine["spec"], ec)
    arena = hc["command"][hc["command"].index("--arena") + 1]
    assert ec["command"][ec["command"].index("--shared-expert-arena") + 1] == arena
    # The engine's /dev/shm for streams is a Memory emptyDir, not the 64 MiB default.
    dshm = [v for v in engine["spec"]["volumes"] if v.get("emptyDir", {}).get("medium")
            == "Memory"]
    assert dshm and any(m["mountPath"] == "/dev/shm" and m["name"] == dshm[0]["name"]
                        for m in ec["volumeMounts"])


@pytest.mark.parametrize("name", ["docker/run-pair.sh", "kubernetes/holder-daemonset.yaml",
                                  "kubernetes/engine-pod.yaml",
                                  "systemd/expert-arena-holder@.service"])
def test_examples_use_flags_the_tools_accept(name):
    text = open(os.path.join(DEPLOY, name)).read()
    load_help = subprocess.run([tool("expert-arena"), "load", "--help"], capture_output=True,
                               text=True, timeout=60).stdout
    engine_help = subprocess.run([tool("moe-engine"), "--help"], capture_output=True, text=True,
                                 timeout=60).stdout
    # Flags of docker and systemctl, not of our tools.
    other_flags = {"--name", "--restart", "--user", "--gpus", "--memory", "--rm", "--shm-size",
                   "--group-add", "--now", "--system"}
    checked = 0
    for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", text)) - other_flags:
        assert re.search(re.escape(flag) + r"\b", load_help + engine_help), (name, flag)
        checked += 1
    assert checked > 0, name


def test_docker_pair_script_parses():
    r = subprocess.run(["bash", "-n", os.path.join(DEPLOY, "docker", "run-pair.sh")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
