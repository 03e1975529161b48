"""The command line's basics: --version, one-line errors for bad input or environment, --debug."""
from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

import ngdist
from ngdist import zoo
from ngdist.cli import main
from ngdist.ir.model import save_proto

TIMEOUT_ERROR = ("ngdist: error: NGDIST_TIMEOUT='abc' is not a number of seconds; set it to e.g. "
                 "300 or unset it\n")


@pytest.fixture
def model(tmp_path) -> Path:
    path = tmp_path / "training.onnx"
    save_proto(ngdist.to_training_model(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1)),
               path)
    return path


def test_version(cli, tmp_path):
    proc = cli("--version", cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"ngdist {ngdist.__version__}\n", "")


def test_help_with_a_malformed_timeout(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "abc")
    for args in (["--help"], ["rewrite", "--help"]):
        proc = cli(*args, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith("usage: ngdist")
        assert proc.stderr == ""


def test_malformed_timeout_is_one_line_before_any_work(cli, model, tmp_path, monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "abc")
    proc = cli("rewrite", model.name, "-o", "dist.onnx", cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", TIMEOUT_ERROR)
    assert not (tmp_path / "dist.onnx").exists()
    monkeypatch.setenv("NGDIST_TIMEOUT", "-5")
    proc = cli("run", "-n", "2", "--", "true", cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (
        1, "ngdist: error: NGDIST_TIMEOUT='-5' must be a positive number of seconds\n")


def test_malformed_timeout_in_process(model, capsys, monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "abc")
    assert main(["inspect", str(model)]) == 1
    assert capsys.readouterr().err == TIMEOUT_ERROR


@pytest.mark.parametrize("args, message", [
    (["inspect", "adir"], "adir: is a directory, not a regular file; give the path of an "
                          ".onnx file"),
    (["rewrite", "training.onnx", "-o", "adir"], "adir: Is a directory"),
    (["rewrite", "training.onnx", "-o", "afile/dist.onnx"], "afile/dist.onnx: Not a directory"),
])
def test_os_error_is_one_line_naming_the_path(cli, model, tmp_path, args, message):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("not a folder")
    proc = cli(*args, cwd=tmp_path)
    assert (proc.returncode, proc.stdout, proc.stderr) == (1, "", f"ngdist: error: {message}\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile", "training.onnx"]


def test_permission_denied_is_one_line_naming_the_path(model, capsys, monkeypatch):
    real_open = os.open

    def denied(path, *args, **kwargs):
        if str(path) == str(model):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", denied)
    assert main(["inspect", str(model)]) == 1
    assert capsys.readouterr().err == f"ngdist: error: {model}: Permission denied\n"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_unreadable_file(cli, model, tmp_path):
    model.chmod(0)
    proc = cli("inspect", model.name, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (1, f"ngdist: error: {model.name}: Permission denied\n")


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback(cli, tmp_path, monkeypatch, how):
    (tmp_path / "adir").mkdir()
    if how == "env":
        monkeypatch.setenv("NGDIST_DEBUG", "1")
    proc = cli(*(["--debug"] if how == "flag" else []), "inspect", "adir", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Traceback (most recent call last):")
    assert proc.stderr.splitlines()[-1] == ("ngdist.errors.ModelLoadError: adir: is a directory, "
                                            "not a regular file; give the path of an .onnx file")


def test_debug_off_with_zero(tmp_path, capsys, monkeypatch):
    (tmp_path / "adir").mkdir()
    monkeypatch.setenv("NGDIST_DEBUG", "0")
    assert main(["inspect", str(tmp_path / "adir")]) == 1
    assert capsys.readouterr().err == (f"ngdist: error: {tmp_path / 'adir'}: is a directory, not "
                                       "a regular file; give the path of an .onnx file\n")


def test_debug_reraises_ngdist_errors_in_process(tmp_path, monkeypatch):
    monkeypatch.setenv("NGDIST_TIMEOUT", "abc")
    with pytest.raises(ngdist.CommError, match="NGDIST_TIMEOUT='abc'"):
        main(["--debug", "inspect", str(tmp_path / "missing.onnx")])


def test_run_and_train_launch_the_same_number_of_ranks_by_default():
    from ngdist.cli import build_parser
    from ngdist.cli.run import rank_count

    parser = build_parser()
    run = parser.parse_args(["run", "--", "python", "train.py"])
    train = parser.parse_args(["train", "mlp.onnx", "--data", "d.npz"])
    assert rank_count(run, {}) == train.n == 1  # outside a Slurm allocation
    assert rank_count(run, {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8"}) == 8
