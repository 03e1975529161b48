"""The README's "Running on a cluster" and "From Python or a notebook" sections, run as written
(sizes scaled to this one machine), on a real one-node Slurm cluster started here.

The Slurm fixture starts munged, slurmctld and slurmd (Debian's slurm-wlm; ``.ci/run`` installs
it) as root from a private folder, with ports of their own and ``proctrack/pgid`` /
``task/none`` (no cgroups), and waits until the node is idle. Where Slurm is missing it
installs it with apt-get (a fresh Debian machine, as root); it fails when Slurm is still not
installed (a broken install must not pass as a skip) and skips only where the daemons cannot
run: not root, or (with the daemons' logs in the reason) they would not come up here.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
VENV_BIN = Path(sys.executable).parent
LIMIT = 200  # any one job here; well below pytest-timeout's 300 s
DAEMONS = ("munged", "slurmctld", "slurmd")


def section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start:end if end >= 0 else None]


def blocks(title: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(title), re.S)


def env_with_venv(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The README's user, with the venv activated (its bin first on PATH)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({"PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    return {**env, **(extra or {})}


def run(cmd: str | list[str], cwd: Path, env: dict[str, str], timeout: float = LIMIT,
        ) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, shell=isinstance(cmd, str), cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{cmd!r} did not end within {timeout} s:\n{exc.stdout!r}\n{exc.stderr!r}")


# ----------------------------------------------------------------------------- the cluster

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(folder: Path, host: str) -> str:
    return "\n".join([
        "ClusterName=ngdisttest", f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={_free_port()}", f"SlurmdPort={_free_port()}",
        "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
        f"AuthInfo=socket={folder}/munge/sock", "CredType=cred/munge",
        "ProctrackType=proctrack/pgid", "TaskPlugin=task/none", "MpiDefault=none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_CPU", "ReturnToService=2",
        f"StateSaveLocation={folder}/state", f"SlurmdSpoolDir={folder}/spool",
        f"SlurmctldPidFile={folder}/slurmctld.pid", f"SlurmdPidFile={folder}/slurmd.pid",
        f"SlurmctldLogFile={folder}/slurmctld.log", f"SlurmdLogFile={folder}/slurmd.log",
        "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
        "SlurmdParameters=config_overrides",  # 4 CPUs declared whatever the machine has
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN",
        "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""])


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(procs):
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def slurm(tmp_path_factory) -> Iterator[dict[str, str]]:
    """A one-node Slurm cluster; yields the environment its clients need (SLURM_CONF)."""
    if os.geteuid() != 0:
        pytest.skip("slurmd and munged of a private test cluster need root")
    missing = _missing_slurm()
    if missing and shutil.which("apt-get"):  # a fresh Debian machine: install it, as .ci/run does
        _install_slurm()
        missing = _missing_slurm()
    assert not missing, (f"Slurm is not installed (no {', '.join(missing)}): `apt-get install "
                         "-y slurm-wlm munge`, as .ci/run does")
    folder = tmp_path_factory.mktemp("slurm")
    for sub in ("munge", "state", "spool"):
        (folder / sub).mkdir(mode=0o700)
    key = folder / "munge" / "key"
    key.write_bytes(Path("/etc/munge/munge.key").read_bytes() if Path("/etc/munge/munge.key")
                    .exists() else os.urandom(128))
    key.chmod(0o600)
    host = socket.gethostname()
    conf = folder / "slurm.conf"
    conf.write_text(_slurm_conf(folder, host))
    m = folder / "munge"
    commands = [
        [_sbin("munged"), "-F", "--force", "--num-threads=10", f"--socket={m}/sock",
         f"--key-file={key}", f"--pid-file={m}/pid", f"--log-file={m}/log",
         f"--seed-file={m}/seed"],
        [_sbin("slurmctld"), "-D", "-f", str(conf)],
        [_sbin("slurmd"), "-D", "-f", str(conf), "-N", host]]
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []
    try:
        for cmd in commands:
            with open(folder / f"{Path(cmd[0]).name}.out", "wb") as out:
                procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True))
            if cmd[0].endswith("munged"):
                _wait_for(lambda: (m / "sock").exists(), 20, procs, folder)
        _wait_for(lambda: _node_idle(env), 60, procs, folder)
        yield {"SLURM_CONF": str(conf)}
    finally:
        _stop(procs)


def _missing_slurm() -> list[str]:
    return [d for d in (*DAEMONS, "salloc", "sbatch", "srun", "sinfo") if not shutil.which(d)
            and not Path("/usr/sbin", d).exists()]


def _install_slurm() -> None:
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "slurm-wlm",
                                              "munge"]):
        subprocess.run(cmd, env=env, capture_output=True, timeout=LIMIT, check=False)


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _node_idle(env: dict[str, str]) -> bool:
    out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=env, capture_output=True, text=True,
                         timeout=20).stdout.split()
    return out == ["idle"]


def _wait_for(ready, within: float, procs: list[subprocess.Popen], folder: Path) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            break
        if ready():
            return
        time.sleep(0.5)
    logs = "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-1500:]}"
                     for f in sorted(folder.glob("*.out")) + sorted(folder.glob("*.log")))
    _stop(procs)
    pytest.skip(f"the one-node Slurm cluster did not come up as root within {within:g} s "
                f"(slurmd cannot run here):\n{logs}")


# ----------------------------------------------------------------------------- the README

@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    """A folder as the README's reader has it: .venv, mlp.onnx and train.py (the one-liner)."""
    folder = tmp_path_factory.mktemp("project")
    (folder / ".venv").symlink_to(VENV_BIN.parent)
    probe = 'import os\nprint("STEP", os.environ.get("SLURM_STEP_ID"))  # the srun step, if any\n'
    (folder / "train.py").write_text(probe + blocks("The one-liner", "python")[0])
    make = re.search(r'`(python -c "import ngdist.zoo.*?")`', README).group(1)
    proc = run(make, folder, env_with_venv())
    assert proc.returncode == 0, proc.stderr
    return folder


def trained(folder: Path) -> str:
    return hashlib.sha256((folder / "trained.onnx").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(project) -> str:
    """trained.onnx of the one-liner on 2 ranks without Slurm: what every launch must match."""
    proc = run("ngdist run -n 2 -- python train.py", project, env_with_venv())
    assert proc.returncode == 0, proc.stderr
    return trained(project)


def test_the_salloc_command_trains_through_srun(project, reference, slurm):
    (salloc,) = [line for b in blocks("Running on a cluster", "bash") for line in b.splitlines()
                 if line.startswith("salloc ")]
    assert salloc == "salloc -N 2 -n 8 ngdist run -- python train.py"
    (project / "trained.onnx").unlink()
    command = salloc.replace("-N 2 -n 8", "-n 2").replace(
        "ngdist run", "ngdist -v run")  # -v: the line that says srun launched it
    proc = run(command, project, env_with_venv(slurm))
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"INFO ngdist.cli.run: inside Slurm job \d+: 2 ranks through srun on ",
                     proc.stderr), proc.stderr
    steps = sorted(re.findall(r"\[rank (\d)\] STEP (\d+)", proc.stdout))
    assert steps == [("0", "0"), ("1", "0")], proc.stdout  # in a job step: started by srun
    assert trained(project) == reference  # bit for bit as without Slurm


def test_the_sbatch_script_trains_through_srun(project, reference, slurm):
    (script,) = [b for b in blocks("Running on a cluster", "bash") if b.startswith("#!")]
    script = script.replace("--nodes=2", "--nodes=1").replace("--ntasks-per-node=4",
                                                              "--ntasks-per-node=2")
    (project / "train.sbatch").write_text(script)
    (project / "trained.onnx").unlink()
    proc = run("sbatch --wait train.sbatch", project, env_with_venv(slurm))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job = re.search(r"Submitted batch job (\d+)", proc.stdout).group(1)
    log = (project / f"train.{job}.log").read_text()
    # the ranks run in a job step of their own: started by srun, not by the batch script
    assert sorted(re.findall(r"\[rank (\d)\] STEP (\d+)", log)) == [("0", "0"), ("1", "0")], log
    assert trained(project) == reference


def test_the_hostfile_command_trains(project, reference):
    hostfile = [b for b in blocks("Running on a cluster", "") if "node1:4" in b][0]
    assert hostfile == "node1:4\nnode2:4\n"
    (project / "hosts").write_text("localhost:2\n")  # this machine stands for both nodes
    command = re.search(r"`(ngdist run -n 8 --hostfile hosts -- python train.py)`",
                        section("Running on a cluster")).group(1)
    (project / "trained.onnx").unlink()
    proc = run(command.replace("-n 8", "-n 2"), project, env_with_venv())
    assert proc.returncode == 0, proc.stderr
    assert trained(project) == reference


def test_the_notebook_example_returns_each_ranks_loss(project):
    (code,) = blocks("From Python or a notebook", "python")
    proc = run([sys.executable, "-c", code], project, env_with_venv())
    assert proc.returncode == 0, proc.stderr
    losses = eval(proc.stdout.strip().splitlines()[-1])
    assert len(losses) == 2 and all(0 < loss < 2.4 for loss in losses), proc.stdout


def test_launch_inside_an_allocation_runs_the_ranks_through_srun(project, slurm):
    code = ("import os, ngdist\n"
            "def where():\n"
            "    return ngdist.rank(), os.environ.get('SLURM_STEP_ID')\n"
            "print('RESULT', ngdist.launch(where, n=2))\n")
    proc = run(["salloc", "-n", "2", sys.executable, "-c", code], project, env_with_venv(slurm))
    assert proc.returncode == 0, proc.stderr
    assert "RESULT [(0, '0'), (1, '0')]" in proc.stdout.splitlines(), proc.stdout
