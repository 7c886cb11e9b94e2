"""Group sharing from Python: `open(file_mode=0o660)` gives the arena exactly that mode whatever
the umask, and an engine of another user in that group attaches (`allow_foreign_owner=True`),
read-only when the mode gives the group read only (docs/deployment.md, "Users and groups").
The other user is a child started with subprocess's user=/group=/extra_groups= (numeric ids,
nothing added to /etc/passwd); it needs root, and is skipped without it."""

import os
import stat
import subprocess
import sys

import pytest

import expert_arena
from conftest import child_env

GROUP, MEMBER = 64200, 64201

ATTACH = """
import sys, expert_arena
with expert_arena.attach(sys.argv[1], allow_foreign_owner=True) as a:
    name = a.names()[0]
    print(a.report["role"], int(a.numpy(name).view("u1").astype("u8").sum()))
"""


@pytest.mark.parametrize("mode", [0o660, 0o640])
@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_group_mode_whatever_the_umask_and_a_member_attaches(gen_model, shm_path, mode, umask):
    path = shm_path("users")
    old = os.umask(umask)
    try:
        arena = expert_arena.open([gen_model()], shared_path=path, file_mode=mode, quiet=True)
    finally:
        os.umask(old)
    with arena:
        assert stat.S_IMODE(os.stat(path).st_mode) == mode
        if os.geteuid() != 0:
            pytest.skip("attaching as another user needs root (setresuid)")
        assert os.stat(os.path.dirname(path)).st_mode & 0o001, \
            "%s must be searchable by other users" % os.path.dirname(path)
        os.chown(path, os.geteuid(), GROUP)
        # The arena lives in /dev/shm; the member must reach the package and the model.
        name = arena.names()[0]
        want = int(arena.numpy(name).view("u1").astype("u8").sum())
        r = subprocess.run([sys.executable, "-c", ATTACH, path], env=child_env(),
                           user=MEMBER, group=MEMBER, extra_groups=[GROUP],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        role, got = r.stdout.split()
        assert role == "attached" and int(got) == want


ATTACH_WORLD_WRITABLE = """
import sys, expert_arena
try:
    with expert_arena.attach(sys.argv[1], allow_foreign_owner=True):
        print("attached")
except PermissionError as e:
    print("refused:", e)
with expert_arena.attach(sys.argv[1], allow_foreign_owner=True, allow_world_writable=True) as a:
    print(a.report["role"])
"""


def test_another_user_does_not_attach_to_a_world_writable_arena_unless_asked(gen_model,
                                                                             shm_path):
    """An arena any user may write (chmod 0666 by hand after it was made): any user could
    change the bytes under every engine, so an engine of another user refuses it, saying why and
    how to fix it, unless it asks for it by name."""
    if os.geteuid() != 0:
        pytest.skip("attaching as another user needs root (setresuid)")
    path = shm_path("users")
    with expert_arena.open([gen_model()], shared_path=path, quiet=True):
        pass
    os.chmod(path, 0o666)
    r = subprocess.run([sys.executable, "-c", ATTACH_WORLD_WRITABLE, path], env=child_env(),
                       user=MEMBER, group=MEMBER, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    refused, attached = r.stdout.splitlines()
    assert refused.startswith("refused: %s has mode 0666: any user may write it" % path), refused
    assert "chmod o-w %s" % path in refused
    assert attached == "attached"
