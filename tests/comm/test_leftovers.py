"""Shared-memory files that a failed job leaves in /dev/shm: found and removed by the launcher.

The unit tests work in a temporary folder with files this process or a child maps; the
end-to-end tests run ``ngdist run`` on jobs whose rank is killed (SIGKILL) or aborts the MPI
job, both of which leave MPICH's ``mpich_shm_*`` segments without the launcher's clean-up.
"""
from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ngdist.comm import leftovers

sys.path.insert(0, str(Path(__file__).parent))
from test_supervisor import ngdist_run, script  # noqa: E402


def make(folder: Path, name: str) -> Path:
    path = folder / name
    path.write_bytes(b"\0" * 4096)
    return path


def test_a_new_file_that_no_process_maps_is_left_over_and_removed(tmp_path):
    before = leftovers.snapshot(str(tmp_path))
    old = make(tmp_path, "mpich_shm_old_0")  # appeared before the job: not the job's
    before = leftovers.snapshot(str(tmp_path))
    new = make(tmp_path, "mpich_shm_abc_0")
    ours = make(tmp_path, "ngdist-123-0")
    other = make(tmp_path, "somebody_elses_segment")
    assert leftovers.find(before, str(tmp_path), settle_s=0) == [str(new), str(ours)]
    assert leftovers.remove(before, str(tmp_path), settle_s=0) == 2
    assert sorted(os.listdir(tmp_path)) == [old.name, other.name]


def test_a_file_this_process_maps_is_kept(tmp_path):
    before = leftovers.snapshot(str(tmp_path))
    path = make(tmp_path, "mpich_shm_live_0")
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        assert leftovers.find(before, str(tmp_path), settle_s=0) == []
        assert leftovers.remove(before, str(tmp_path), settle_s=0) == 0
    assert path.exists()
    assert leftovers.find(before, str(tmp_path), settle_s=0) == [str(path)]


def test_a_file_another_live_process_maps_is_kept(tmp_path):
    """A segment of another job that still runs: one of its processes maps it."""
    before = leftovers.snapshot(str(tmp_path))
    path = make(tmp_path, "mpich_shm_peer_0")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import mmap, sys, time\n"
         "fh = open(sys.argv[1], 'r+b'); m = mmap.mmap(fh.fileno(), 4096); fh.close()\n"
         "print('mapped', flush=True); time.sleep(60)", str(path)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "mapped\n"
        assert leftovers.remove(before, str(tmp_path), settle_s=0) == 0
        assert path.exists()
    finally:
        holder.kill()
        holder.wait(10)
    assert leftovers.remove(before, str(tmp_path), settle_s=0) == 1
    assert not path.exists()


def test_mapped_paths_lists_what_a_process_maps(tmp_path):
    path = make(tmp_path, "mapped_file")
    with open(path, "r+b") as fh, mmap.mmap(fh.fileno(), 4096):
        assert str(path) in leftovers.mapped_paths([str(os.getpid())])
    assert str(path) not in leftovers.mapped_paths([str(os.getpid())])
    assert leftovers.mapped_paths(["999999999"]) == set()  # no such process


DIES = """
import os, signal, sys, time
from mpi4py import MPI
MPI.COMM_WORLD.Barrier()  # MPICH has made its shared memory by now
if MPI.COMM_WORLD.Get_rank() == 1:
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    MPI.COMM_WORLD.Abort(4)
time.sleep(60)
"""


@pytest.mark.mpi
@pytest.mark.skipif(not os.path.isdir(leftovers.SHM_DIR), reason="no /dev/shm on this host")
@pytest.mark.parametrize("how, status", [("kill", 137), ("abort", 4)])
def test_a_failed_job_leaves_no_shared_memory_behind(tmp_path, how, status):
    before = leftovers.snapshot()
    path = script(tmp_path, DIES)
    proc = ngdist_run(tmp_path, path, how, options=("--grace", "0"))
    assert proc.returncode == status, proc.stderr
    assert leftovers.find(before) == []  # files of jobs running beside this one are mapped
