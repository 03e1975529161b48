"""Typed options on the command line: ``ngdist rewrite`` and ``ngdist train`` refuse a strategy
flag that the chosen strategy does not take, a misspelt flag and a bad optimizer spec with one
``ngdist: error:`` line (exit 1) naming the valid ones; a forward-only model needs
``--optimizer`` for ``rewrite``; valid flags still work."""
from __future__ import annotations

import argparse

import numpy as np
import onnx
import pytest

import ngdist
from ngdist import zoo
from ngdist.cli import main
from ngdist.cli import train as train_cli
from ngdist.data import load_digits
from ngdist.ir.model import save_proto
from ngdist.optim import SGD

PUSHSUM_FLAGS = "--graph, --overlap, --peers-per-itr, --synch-freq"


@pytest.fixture
def files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    x, y, _, _ = load_digits()
    onnx.save(zoo.mlp((64, 8, 10), seed=0), tmp_path / "mlp.onnx")
    np.savez(tmp_path / "digits.npz", x=x[:64], y=y[:64])
    return tmp_path


def _error(capsys, *argv: str) -> str:
    """The one line ``ngdist ARGV`` prints on stderr, asserting exit code 1."""
    assert main(list(argv)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ngdist: error: "), err
    return err.strip()


REWRITE = ("rewrite", "mlp.onnx", "-o", "out.onnx")


@pytest.mark.parametrize("command", [REWRITE, ("train", "mlp.onnx", "--data", "digits.npz")])
def test_flag_of_another_strategy_is_refused(files, capsys, command):
    assert _error(capsys, *command, "--optimizer", "sgd:lr=0.1", "--strategy", "pushsum",
                  "--all-reduce-alg", "ring") == (
        "ngdist: error: --all-reduce-alg is an option of the allreduce strategy, not of "
        f"'pushsum'; options of 'pushsum': {PUSHSUM_FLAGS}")
    assert _error(capsys, *command, "--optimizer", "sgd:lr=0.1", "--strategy", "simple",
                  "--bucket-bytes", "4096") == (
        "ngdist: error: --bucket-bytes is an option of the allreduce strategy, not of "
        "'simple'; 'simple' takes no options")
    assert _error(capsys, *command, "--optimizer", "sgd:lr=0.1", "--overlap") == (
        "ngdist: error: --overlap is an option of the pushsum strategy, not of 'allreduce'; "
        "options of 'allreduce': --all-reduce-alg, --bucket-bytes, --compression, "
        "--compression-error-feedback, --reproducible-micro-batch, --shard, --shard-ranks")
    assert not (files / "out.onnx").exists()


@pytest.mark.parametrize("command", [REWRITE, ("train", "mlp.onnx", "--data", "digits.npz")])
def test_misspelt_flag_suggests_the_closest(files, capsys, command):
    name = f"ngdist {command[0]}"
    assert _error(capsys, *command, "--optimizer", "sgd:lr=0.1", "--strategy", "pushsum",
                  "--peers-per-iter", "2") == (
        f"ngdist: error: unknown option '--peers-per-iter' for {name}; did you mean "
        f"'--peers-per-itr'? Options of strategy 'pushsum': {PUSHSUM_FLAGS} ({name} -h lists "
        "every option)")
    assert _error(capsys, *command, "--optimiser=sgd:lr=0.1") == (
        f"ngdist: error: unknown option '--optimiser' for {name}; did you mean '--optimizer'? "
        "Options of strategy 'allreduce': --all-reduce-alg, --bucket-bytes, --compression, "
        f"--compression-error-feedback, --reproducible-micro-batch, --shard, --shard-ranks "
        f"({name} -h lists every option)")


def test_optimizer_spec_with_an_unknown_key(files, capsys):
    assert _error(capsys, *REWRITE, "--optimizer", "sgd:learning_rate=0.1") == (
        "ngdist: error: unknown key 'learning_rate' for optimizer 'sgd' in "
        "'sgd:learning_rate=0.1'; did you mean 'lr'? Valid keys of sgd: dampening, lr, "
        "maximize, momentum, "
        "nesterov, scheduled_momentum, weight_decay")


def test_rewrite_of_a_forward_only_model_needs_an_optimizer(files, capsys):
    assert _error(capsys, *REWRITE) == (
        "ngdist: error: mlp.onnx is a forward-only model: pass --optimizer (e.g. "
        "sgd:lr=0.05,momentum=0.9 or adam:lr=1e-3) to build its training step")
    assert not (files / "out.onnx").exists()
    # a training model needs none, and takes none
    save_proto(ngdist.to_training_model(zoo.mlp((64, 8, 10)), optimizer=SGD(lr=0.1)),
               files / "training.onnx")
    assert main(["rewrite", "training.onnx", "-o", "again.onnx"]) == 0
    capsys.readouterr()
    assert _error(capsys, "rewrite", "training.onnx", "-o", "x.onnx", "--optimizer",
                  "sgd:lr=0.1", "--loss", "mse") == (
        "ngdist: error: training.onnx is already a training model (it has training_info); "
        "--loss, --optimizer are for forward-only models")


def test_valid_flags_reach_the_rewritten_model(files, capsys):
    assert main([*REWRITE, "--optimizer", "sgd:lr=0.1,momentum=0.9", "--strategy", "pushsum",
                 "--graph", "ring", "--peers-per-itr", "2", "--overlap",
                 "--synch-freq", "1"]) == 0
    assert capsys.readouterr().out == "wrote out.onnx (strategy pushsum)\n"
    model = onnx.load(files / "out.onnx")
    (node,) = [n for n in model.training_info[0].algorithm.node if n.domain == "ngdist"]
    assert (node.op_type, {a.name: onnx.helper.get_attribute_value(a)
                           for a in node.attribute}) == \
        ("PushSum", {"graph": b"ring", "peers_per_itr": 2, "overlap": 1, "synch_freq": 1})
    assert {(kv.key, kv.value) for kv in model.training_info[0].update_binding} >= \
        {("fc0.weight.momentum", "fc0.weight.momentum.new")}  # sgd spec: momentum state


def test_train_passes_strategy_flags_to_compile_and_to_the_ranks(files, capsys):
    assert main(["train", "mlp.onnx", "--data", "digits.npz", "--optimizer", "sgd:lr=0.1",
                 "--strategy", "pushsum", "--peers-per-itr", "1", "--overlap",
                 "--batch-size", "16"]) == 0
    assert "trained 1 epoch(s), 4 steps of 16 samples on 1 rank(s)" in capsys.readouterr().out
    p = argparse.ArgumentParser()
    train_cli.add_arguments(p)
    args = p.parse_args(["mlp.onnx", "--data", "digits.npz", "-n", "2", "--strategy", "ps",
                         "--grad-shard-bytes", "4096", "--servers", "1"])
    argv = train_cli.relaunch_argv(args)
    assert argv[argv.index("--grad-shard-bytes"):] == ["--grad-shard-bytes", "4096",
                                                       "--servers", "1"]


def test_relaunched_rank_refuses_a_misplaced_flag_too(files, capsys):
    # the entry mpiexec starts (python -m ngdist.cli.train), on one rank
    assert train_cli.main(["mlp.onnx", "--data", "digits.npz", "--strategy", "ps",
                           "--synch-freq", "2"]) == 1
    assert capsys.readouterr().err == (
        "ngdist: error: --synch-freq is an option of the pushsum strategy, not of 'ps'; "
        "options of 'ps': --grad-shard-bytes, --servers\n")


def test_command_line_error_is_one_line_with_exit_code_1(files, cli):
    proc = cli("rewrite", "mlp.onnx", "-o", "out.onnx", "--optimizer", "sgd:lr=0.1",
               "--strategy", "pushsum", "--all-reduce-alg", "ring", cwd=files)
    assert proc.returncode == 1
    assert proc.stderr == (
        "ngdist: error: --all-reduce-alg is an option of the allreduce strategy, not of "
        f"'pushsum'; options of 'pushsum': {PUSHSUM_FLAGS}\n")
