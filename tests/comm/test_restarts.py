"""``ngdist run --max-restarts`` / ``--min-ranks`` and Trainer checkpoints.

The multi-rank tests start the real command line (``python -m ngdist run``) under the venv's
mpiexec: a rank of the first attempt kills itself with SIGKILL (``NGDIST_RESTART_COUNT=0``),
the job is relaunched and resumes from the newest checkpoint. The oracle is an uninterrupted
run of the same program (reproducible mode: the same bits on any rank count). Checkpoint files
are checked against a process killed inside the write (os.replace patched to SIGKILL itself).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ngdist.comm.supervisor import JobResult, RankStatus, next_ranks
from ngdist import CheckpointError
from ngdist.runtime import checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from test_supervisor import ENV, LIMIT, alive, cleanup, gone_within, ngdist_run, script  # noqa: E402

STEPS, GLOBAL_BATCH, EVERY, KILL_AFTER = 10, 16, 3, 6

# trains STEPS steps of the digits MLP from the checkpoint folder's newest step on; the last
# rank of the first attempt kills itself after step KILL_AFTER (index), so the job resumes from
# the checkpoint of step 6 and trains step index 6 again
TRAIN = """
import os, signal, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

out, folder = sys.argv[1], sys.argv[2]
kill = {kill} and os.environ.get("NGDIST_RESTART_COUNT") == "0"
x, y, _, _ = load_digits()
tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                    reproducible_micro_batch=4, checkpoint_every={EVERY},
                    checkpoint_dir=folder, timeout=30)
print(f"attempt {{os.environ.get('NGDIST_RESTART_COUNT')}} on {{tr.size}} rank(s) from step "
      f"{{tr.resumed_from}}", flush=True)
for s in range(tr.resumed_from, {STEPS}):
    batch = {{"x": x[s * {GLOBAL_BATCH}:(s + 1) * {GLOBAL_BATCH}],
              "y": y[s * {GLOBAL_BATCH}:(s + 1) * {GLOBAL_BATCH}]}}
    for shard in tr.shard([batch]):
        tr.step(shard)
    if kill and s == {KILL_AFTER} and tr.rank == tr.size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
if tr.rank == 0:
    np.savez(out, **tr.state_dict())
tr.close()
"""


def train(tmp_path: Path, name: str, *options: str, kill: bool, n: int = 2
          ) -> tuple[subprocess.CompletedProcess, dict[str, np.ndarray] | None]:
    text = TRAIN.format(kill=kill, EVERY=EVERY, STEPS=STEPS, GLOBAL_BATCH=GLOBAL_BATCH,
                        KILL_AFTER=KILL_AFTER)
    path = script(tmp_path, text, f"{name}.py")
    proc = ngdist_run(tmp_path, path, f"{name}.npz", f"ckpt_{name}", n=n, options=options)
    assert gone_within(path, 5) == ""
    out = tmp_path / f"{name}.npz"
    if not out.exists():
        return proc, None
    with np.load(out) as npz:
        return proc, dict(npz)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, np.ndarray]:
    """The state after STEPS steps on 2 ranks, no failure (the oracle)."""
    proc, state = train(tmp_path_factory.mktemp("oracle"), "oracle", kill=False)
    assert proc.returncode == 0, proc.stderr
    assert state is not None and state["ngdist.step"].item() == STEPS
    return state


def assert_same_state(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:  # bit-for-bit: parameters, momentum, step counter, learning rate
        assert a[name].dtype == b[name].dtype and a[name].tobytes() == b[name].tobytes(), name


# ----------------------------------------------------------------------------- restarts

@pytest.mark.mpi
@pytest.mark.parametrize("min_ranks, last_ranks, grace", [(None, 2, "0"), ("1", 1, "0"),
                                                          (None, 2, "20")])
def test_a_killed_rank_restarts_the_job_which_resumes_bit_for_bit(tmp_path, uninterrupted,
                                                                  min_ranks, last_ranks, grace):
    """``--grace 0``: the supervisor stops the surviving rank as soon as it sees the death;
    ``--grace 20``: the survivor's own dead-peer check ends it first (a few seconds). Either
    way the job restarts and resumes from the newest checkpoint."""
    options = ("--max-restarts", "1", "--grace", grace)
    options += ("--min-ranks", min_ranks) if min_ranks else ()
    proc, state = train(tmp_path, "killed", *options, kill=True)
    assert proc.returncode == 0, proc.stderr
    restart = [line for line in proc.stderr.splitlines() if line.startswith("ngdist:")]
    stopped = "stopped the other 1 rank; " if grace == "0" else ""
    assert restart == [f"ngdist: attempt 1 of 2 failed: rank 1 failed (Killed (signal 9)); "
                       f"{stopped}restarting on "
                       f"{'1 rank' if last_ranks == 1 else '2 ranks'} (NGDIST_RESTART_COUNT=1)"]
    if not stopped:  # the survivor's own error names the rank that died
        assert "cannot complete on rank 0: the process of rank 1 (pid " in proc.stderr
    starts = sorted(line for line in proc.stdout.splitlines() if "attempt" in line)
    expected = ["[rank 0] attempt 0 on 2 rank(s) from step 0",
                "[rank 0] attempt 1 on %d rank(s) from step 6" % last_ranks,
                "[rank 1] attempt 0 on 2 rank(s) from step 0"]
    if last_ranks == 2:
        expected.append("[rank 1] attempt 1 on 2 rank(s) from step 6")
    assert starts == sorted(expected)
    assert state is not None
    assert_same_state(state, uninterrupted)
    listed = [e["steps_done"] for e in checkpoint.read_manifest(tmp_path / "ckpt_killed")]
    assert listed == [3, 6, 9]
    assert sorted(os.listdir(tmp_path / "ckpt_killed")) == [
        "manifest.json", "step-00000003.npz", "step-00000006.npz", "step-00000009.npz"]


@pytest.mark.mpi
def test_without_restarts_a_killed_rank_fails_the_job(tmp_path):
    # --grace 1: the launcher stops the survivor 1 s after the death (not the default 3 s)
    proc, state = train(tmp_path, "once", "--max-restarts", "0", "--grace", "1", kill=True)
    assert proc.returncode == 128 + signal.SIGKILL, proc.stderr
    assert state is None
    assert "restarting" not in proc.stderr
    table = proc.stderr[proc.stderr.index("ngdist: rank 1 failed"):].splitlines()
    assert table[0] == "ngdist: rank 1 failed (Killed (signal 9)); stopped the other 1 rank"
    assert "attempt 1" not in proc.stdout


FAILS_FIRST = """
import os, sys, time
attempt = os.environ["NGDIST_RESTART_COUNT"]
print(f"ready {attempt}", flush=True)
if attempt == "0" and os.environ["PMI_RANK"] == "1":
    sys.exit(3)
while True:
    time.sleep(0.1)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("when", ["restarting", "ready 1"])
def test_sigterm_during_a_restart_stops_everything_and_never_restarts(tmp_path, when):
    """SIGTERM as the restart line is printed (between two attempts) or once the second
    attempt runs: exit 143, no third attempt, no process left. (``--grace 1``: the first
    attempt's survivor is stopped 1 s after rank 1's exit, not the default 3 s.)"""
    path = script(tmp_path, FAILS_FIRST)
    log = open(tmp_path / "out.txt", "wb")  # noqa: SIM115
    proc = subprocess.Popen([sys.executable, "-m", "ngdist", "run", "-n", "2",
                             "--max-restarts", "5", "--grace", "1", "--",
                             sys.executable, str(path)],
                            stdout=log if when == "restarting" else subprocess.PIPE,
                            stderr=subprocess.PIPE if when == "restarting" else log,
                            env=ENV, cwd=tmp_path)
    stream = proc.stderr if when == "restarting" else proc.stdout
    assert stream is not None
    seen, deadline = b"", time.monotonic() + LIMIT
    while seen.count(when.encode()) < (1 if when == "restarting" else 2):
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            cleanup(path)
            pytest.fail(f"no {when!r}: {seen!r}")
        seen += os.read(stream.fileno(), 4096)
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        cleanup(path)
        pytest.fail("ngdist run still running 15 s after SIGTERM")
    log.close()
    rest = err if when == "restarting" else out
    text = (seen + rest).decode() + (tmp_path / "out.txt").read_text()
    assert proc.returncode == 143, text
    assert "ngdist: terminated (SIGTERM)" in text
    assert "ready 2" not in text and "attempt 2 of 6" not in text
    assert gone_within(path, 5) == ""


def _result(*ranks: RankStatus, first: int | None) -> JobResult:
    return JobResult(1, list(ranks), 1, first_failed=first)


def test_the_next_attempt_drops_the_first_failed_and_the_killed_ranks():
    ok, stopped = RankStatus(0, code=0), RankStatus(1, signal=15, stopped=True)
    first, gone_peer = RankStatus(2, code=1), RankStatus(3, code=1)
    killed = RankStatus(4, signal=9)
    result = _result(ok, stopped, first, gone_peer, killed, first=2)
    assert next_ranks(result, None) == 5      # without --min-ranks: always -n
    assert next_ranks(result, 1) == 3         # less rank 2 (first) and rank 4 (killed)
    assert next_ranks(result, 4) == 4         # never fewer than --min-ranks
    assert next_ranks(_result(ok, RankStatus(1, aborted=2), first=1), 1) == 1


def test_the_flags_are_checked_before_anything_runs(cli, tmp_path):
    for flags, message in [
            (("--max-restarts", "-1"), "--max-restarts must be at least 0, got -1"),
            (("--min-ranks", "3"), "--min-ranks must be between 1 and the number of ranks "
                                   "(-n 2), got 3"),
            (("--checkpoint-every", "0"), "--checkpoint-every must be at least 1, got 0")]:
        proc = cli("run", "-n", "2", *flags, "--", "true", cwd=tmp_path)
        assert (proc.returncode, proc.stderr) == (1, f"ngdist: error: {message}\n")
    proc = cli("train", "mlp.onnx", "--data", "d.npz", "--checkpoint-every", "2", cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (1, "ngdist: error: --checkpoint-every 2 needs a "
                                                 "folder: give --checkpoint-dir DIR too\n")
    proc = cli("run", "--help", cwd=tmp_path)
    for flag in ("--max-restarts K", "--min-ranks M", "--checkpoint-dir DIR",
                 "--checkpoint-every N", "NGDIST_RESTART_COUNT"):
        assert flag in " ".join(proc.stdout.split()), flag


# ----------------------------------------------------------------------------- checkpoints

def _trainer(folder: Path, sizes=(64, 16, 10), **kw):
    import ngdist
    from ngdist import zoo

    return ngdist.compile(zoo.mlp(sizes), optimizer=ngdist.optim.SGD(lr=0.1, momentum=0.9),
                          checkpoint_dir=folder, **kw)


def _steps(trainer, first: int, last: int) -> None:
    from ngdist.data import load_digits

    x, y, _, _ = load_digits()
    for s in range(first, last):
        trainer.step({"x": x[s * 16:(s + 1) * 16], "y": y[s * 16:(s + 1) * 16]})


KILLED_IN_WRITE = """
import os, signal, sys
sys.path.insert(0, {tests!r})
from test_restarts import _steps, _trainer
real, renames = os.replace, []
def replace(src, dst):
    renames.append(dst)
    if len(renames) == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
    real(src, dst)
os.replace = replace
tr = _trainer({folder!r}, checkpoint_every=3)
_steps(tr, 0, 10)
"""


@pytest.mark.parametrize("kill_at, left", [(3, ".step-00000006.npz.ngdist-tmp-"),
                                           (4, "step-00000006.npz")])
def test_a_write_killed_midway_is_never_resumed_from(tmp_path, kill_at, left):
    """Killed at the rename of the second checkpoint (3rd os.replace: its temporary file is
    left) or of the manifest that would list it (4th: the file is there, unlisted)."""
    folder = tmp_path / "ckpt"
    path = script(tmp_path, KILLED_IN_WRITE.format(tests=str(Path(__file__).parent),
                                                   kill_at=kill_at, folder=str(folder)))
    proc = subprocess.run([sys.executable, str(path)], env=ENV, cwd=tmp_path,
                          capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    assert any(e.startswith(left) for e in os.listdir(folder)), os.listdir(folder)
    with np.load(folder / "step-00000003.npz") as npz:
        names = [n for n, _, _ in __import__("json").loads(str(npz["meta"]))["values"]]
        stored = {n: npz[f"a{i}"] for i, n in enumerate(names)}
    resumed = _trainer(folder)
    assert resumed.resumed_from == resumed.steps_done == 3
    state = resumed.state_dict()
    for name, value in stored.items():
        assert state[name].tobytes() == value.reshape(state[name].shape).tobytes(), name
    assert sorted(os.listdir(folder)) == ["manifest.json", "step-00000003.npz"]


def test_a_checkpoint_that_does_not_match_its_manifest_entry_is_skipped(tmp_path, caplog):
    folder = tmp_path / "ckpt"
    tr = _trainer(folder, checkpoint_every=2)
    _steps(tr, 0, 4)
    data = bytearray((folder / "step-00000004.npz").read_bytes())
    data[len(data) // 2] ^= 1
    (folder / "step-00000004.npz").write_bytes(bytes(data))
    assert _trainer(folder).resumed_from == 2
    assert f"checkpoint {folder / 'step-00000004.npz'} does not match its manifest entry" \
        in caplog.text


def test_only_the_newest_checkpoints_are_kept_and_a_resume_continues_exactly(tmp_path):
    folder = tmp_path / "ckpt"
    tr = _trainer(folder, checkpoint_every=1, checkpoint_keep=2)
    _steps(tr, 0, 5)
    assert sorted(os.listdir(folder)) == ["manifest.json", "step-00000004.npz",
                                          "step-00000005.npz"]
    resumed = _trainer(folder)
    _steps(resumed, resumed.resumed_from, 8)
    _steps(tr, 5, 8)
    assert_same_state(resumed.state_dict(), tr.state_dict())


def test_another_models_checkpoint_is_refused_with_the_differences(tmp_path):
    folder = tmp_path / "ckpt"
    _steps(_trainer(folder, checkpoint_every=1), 0, 1)
    with pytest.raises(CheckpointError) as err:
        _trainer(folder, sizes=(64, 12, 10))
    assert str(err.value) == (
        f"checkpoint {folder / 'step-00000001.npz'} belongs to another model: 'fc0.bias' is "
        "float32[16] there, float32[12] here; 'fc0.bias.momentum' is float32[16] there, "
        "float32[12] here; 'fc0.weight' is float32[16, 64] there, float32[12, 64] here; "
        "'fc0.weight.momentum' is float32[16, 64] there, float32[12, 64] here; 'fc1.weight' is "
        "float32[10, 16] there, float32[10, 12] here; and 1 more. Give this model a checkpoint "
        "folder of its own (checkpoint_dir= or NGDIST_CHECKPOINT_DIR), or empty that one to "
        "start afresh")


REFUSED_ON_EVERY_RANK = """
import os, sys
sys.path.insert(0, {tests!r})
from ngdist import CheckpointError
from test_restarts import _trainer
try:
    _trainer({folder!r}, sizes=(64, 12, 10), timeout=30)
except CheckpointError as exc:
    with open(f"refused.{{os.environ['PMI_RANK']}}", "w") as fh:
        fh.write(str(exc))
"""


@pytest.mark.mpi
def test_every_rank_gets_the_refusal_of_another_models_checkpoint(tmp_path, ranks):
    folder = tmp_path / "ckpt"
    _steps(_trainer(folder, checkpoint_every=1), 0, 1)
    proc = ranks(2, REFUSED_ON_EVERY_RANK.format(tests=str(Path(__file__).parent),
                                                 folder=str(folder)), timeout=LIMIT)
    with pytest.raises(CheckpointError) as err:  # the message on one rank
        _trainer(folder, sizes=(64, 12, 10))
    for rank in (0, 1):
        assert (tmp_path / f"refused.{rank}").read_text() == str(err.value)


def test_checkpoint_options_are_checked(tmp_path, monkeypatch):
    import ngdist
    from ngdist import zoo

    with pytest.raises(ngdist.OptionError, match=r"^checkpoint_every=5 needs a folder: pass "
                       r"checkpoint_dir= or set NGDIST_CHECKPOINT_DIR"):
        ngdist.compile(zoo.mlp((64, 16, 10)), checkpoint_every=5, optimizer="sgd:lr=0.01")
    monkeypatch.setenv("NGDIST_CHECKPOINT_DIR", str(tmp_path / "env"))
    monkeypatch.setenv("NGDIST_CHECKPOINT_EVERY", "2")
    tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer="sgd:lr=0.01")
    _steps(tr, 0, 2)
    assert sorted(os.listdir(tmp_path / "env")) == ["manifest.json", "step-00000002.npz"]
    with pytest.raises(CheckpointError, match="under pushsum every rank holds its "
                       "own parameters"):
        ngdist.compile(zoo.mlp((64, 16, 10)), strategy="pushsum", optimizer="sgd:lr=0.01")


def test_ngdist_train_resumes_where_its_checkpoint_ends(cli, tmp_path):
    """One epoch with checkpoints, then two epochs from the same folder: the same bits as two
    epochs in one go (the second run skips the first epoch's steps)."""
    import onnx
    from ngdist import zoo
    from ngdist.data import load_digits

    x, y, _, _ = load_digits()
    np.savez(tmp_path / "d.npz", x=x[:320], y=y[:320].astype(np.int64))
    onnx.save(zoo.mlp((64, 16, 10)), tmp_path / "mlp.onnx")
    common = ("train", "mlp.onnx", "--data", "d.npz", "--batch-size", "32",
              "--optimizer", "sgd:lr=0.1,momentum=0.9")
    for args in [("--epochs", "2", "--save", "whole.onnx"),
                 ("--epochs", "1", "--checkpoint-dir", "ck", "--checkpoint-every", "5"),
                 ("--epochs", "2", "--checkpoint-dir", "ck", "--save", "resumed.onnx")]:
        proc = cli(*common, *args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    assert "resumed from the checkpoint of step 10" in proc.stdout
    whole, resumed = (onnx.load(tmp_path / f) for f in ("whole.onnx", "resumed.onnx"))
    assert [t.raw_data for t in whole.graph.initializer] == \
        [t.raw_data for t in resumed.graph.initializer]
