"""save_proto: atomic writes, ordinary permissions, clean-up of temporary files of killed saves."""
from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import onnx
import pytest

from ngdist import zoo
from ngdist.ir.model import load_proto, save_proto

ROOT = Path(__file__).resolve().parents[2]


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask():
    """``umask(m)`` sets the process umask for the test; the old one comes back after."""
    old = os.umask(0o022)
    os.umask(old)
    yield lambda m: os.umask(m)
    os.umask(old)


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_new_file_gets_the_permissions_open_gives(tmp_path, umask, mask, expected):
    umask(mask)
    path = tmp_path / "mlp.onnx"
    save_proto(zoo.mlp((8, 4, 2)), path)
    assert mode(path) == expected
    with open(tmp_path / "by_open", "wb"):
        pass
    assert mode(tmp_path / "by_open") == expected  # the same as a file open() creates


def test_replaced_file_keeps_its_permissions(tmp_path, umask):
    umask(0o022)
    path = tmp_path / "mlp.onnx"
    save_proto(zoo.mlp((8, 4, 2)), path)
    path.chmod(0o640)
    save_proto(zoo.mlp((8, 5, 2)), path)
    assert mode(path) == 0o640
    assert load_proto(path).graph.initializer[0].dims == [5, 8]


def test_save_leaves_only_the_target(tmp_path):
    save_proto(zoo.mlp((8, 4, 2)), tmp_path / "a.onnx")
    save_proto(zoo.mlp((8, 4, 2)), tmp_path / "a.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx"]


def test_errors_name_the_target(tmp_path):
    (tmp_path / "adir").mkdir()
    with pytest.raises(IsADirectoryError) as info:
        save_proto(zoo.mlp((8, 4, 2)), tmp_path / "adir")
    assert info.value.filename == str(tmp_path / "adir")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError) as info:
        save_proto(zoo.mlp((8, 4, 2)), tmp_path / "afile" / "m.onnx")
    assert info.value.filename == str(tmp_path / "afile" / "m.onnx")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]
    assert list((tmp_path / "adir").iterdir()) == []


# a save that is killed while it writes: os.fsync, called once the bytes are written to the
# temporary file and before the rename, says so and waits to be killed
KILLED_SAVE = """
import os, sys, time
from ngdist import zoo
from ngdist.ir.model import save_proto

def stuck(fd):
    print("writing", flush=True)
    time.sleep(120)

os.fsync = stuck
save_proto(zoo.mlp((64, 32, 10)), sys.argv[1])
"""


def killed_save(tmp_path: Path, target: Path) -> int:
    """Run a save of ``target`` in a child process, SIGKILL it mid-save; its pid."""
    script = tmp_path / "killed_save.py"
    script.write_text(textwrap.dedent(KILLED_SAVE))
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, str(script), str(target)], stdout=subprocess.PIPE,
                            text=True, env=env)
    try:
        assert proc.stdout.readline() == "writing\n"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


def temps(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if ".ngdist-tmp-" in p.name)


def test_killed_save_leaves_the_target_intact_and_the_next_save_cleans_up(tmp_path):
    target = tmp_path / "model.onnx"
    save_proto(zoo.mlp((64, 8, 10)), target)
    before = target.read_bytes()
    pid = killed_save(tmp_path, target)

    assert target.read_bytes() == before  # whole: the old model, not part of the new one
    onnx.checker.check_model(load_proto(target))
    host = socket.gethostname().split(".")[0][:32]
    left = temps(tmp_path)
    assert len(left) == 1 and left[0].startswith(f".model.onnx.ngdist-tmp-{pid}-{host}-"), left
    assert (tmp_path / left[0]).stat().st_size > 0  # it had written into the temporary file

    # temporary files a save must not touch: another target's, a running process's, and
    # one from another host sharing the folder
    others = [f".other.onnx.ngdist-tmp-{pid}-{host}-0123abcd",
              f".model.onnx.ngdist-tmp-{os.getpid()}-{host}-89abcdef",
              f".model.onnx.ngdist-tmp-{pid}-another-host-0123abcd"]
    for name in others:
        (tmp_path / name).write_bytes(b"partial")

    save_proto(zoo.mlp((64, 16, 10)), target)
    assert temps(tmp_path) == sorted(others)
    assert load_proto(target).graph.initializer[0].dims == [16, 64]


def test_killed_first_save_leaves_no_target(tmp_path):
    target = tmp_path / "new.onnx"
    killed_save(tmp_path, target)
    assert not target.exists()
    save_proto(zoo.mlp((8, 4, 2)), target)
    assert temps(tmp_path) == []
