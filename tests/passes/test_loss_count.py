"""A loss that is a mean over the tokens it counts (SoftmaxCrossEntropyLoss with ignore_index or
class weights, a masked mean ``sum(l * mask) / sum(mask)``) is divided by the count of the whole
global batch (passes/losscount.py): N ranks then train as one process on the combined batch,
against torch float64. Strategies that cannot do it refuse such a loss."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import onnx_ir as ir
from onnx import helper

import ngdist
from ngdist import zoo
from loss_count_models import batch, make_trainer, model
from ngdist.errors import GraphError

HERE = Path(__file__).resolve().parent

# 8 samples: shard 0 (samples 0-3) counts 4 labels, shard 1 (samples 4-7) one
X = np.random.default_rng(1).standard_normal((8, 6))
Y = np.array([0, 1, 2, 3, -1, -1, -1, 4])
W0 = np.random.default_rng(0).standard_normal((6, 5))
CLASS_WEIGHTS = np.array([1.0, 2.0, 0.5, 3.0, 1.5])
KINDS = ("ignore", "weights", "masked", "nll")


SCRIPT = '''
import sys

import numpy as np

sys.path.insert(0, sys.argv[1])
from loss_count_models import batch, make_trainer

X, Y = np.load("data.npz")["x"], np.load("data.npz")["y"]
W0, CW = np.load("data.npz")["w0"], np.load("data.npz")["cw"]
for strategy in ("allreduce", "simple"):
    for kind in ("ignore", "weights", "masked", "nll"):
        trainer = make_trainer(kind, W0, CW, strategy=strategy)
        (shard,) = trainer.shard([batch(kind, X, Y)])
        loss = trainer.step(shard).loss
        np.savez(f"{strategy}.{kind}.rank{trainer.rank}.npz", w=trainer.parameters()["w"],
                 loss=loss)
'''


def _torch_step(kind: str) -> tuple[np.ndarray, float]:
    """One SGD step (lr 1) of torch float64 on one process on the combined batch."""
    w = torch.tensor(W0, requires_grad=True)
    logits = torch.from_numpy(X) @ w
    y = torch.from_numpy(Y)
    if kind == "masked":
        keep = y >= 0
        terms = torch.nn.functional.cross_entropy(logits, torch.where(keep, y, 0),
                                                  reduction="none")
        loss = (terms * keep).sum() / keep.sum()
    else:
        loss = torch.nn.functional.cross_entropy(
            logits, y, ignore_index=-1,
            weight=torch.from_numpy(CLASS_WEIGHTS) if kind == "weights" else None)
    loss.backward()
    return W0 - w.grad.numpy(), loss.item()


@pytest.mark.parametrize("kind", KINDS)
def test_one_process_equals_torch(kind):
    trainer = make_trainer(kind, W0, CLASS_WEIGHTS)
    loss = trainer.step(batch(kind, X, Y)).loss
    expected, expected_loss = _torch_step(kind)
    np.testing.assert_allclose(trainer.parameters()["w"], expected, rtol=1e-12)
    assert loss == pytest.approx(expected_loss, rel=1e-12)


@pytest.mark.mpi
def test_two_ranks_with_4_and_1_counted_tokens_equal_torch(ranks, tmp_path):
    np.savez(tmp_path / "data.npz", x=X, y=Y, w0=W0, cw=CLASS_WEIGHTS)
    ranks(2, SCRIPT, args=[str(HERE)], timeout=150)
    for strategy in ("allreduce", "simple"):
        for kind in KINDS:
            expected, expected_loss = _torch_step(kind)
            got = [np.load(tmp_path / f"{strategy}.{kind}.rank{r}.npz") for r in range(2)]
            assert got[0]["w"].tobytes() == got[1]["w"].tobytes(), (strategy, kind)
            err = np.abs(got[0]["w"] - expected).max() / np.abs(expected).max()
            assert err < 1e-6, (strategy, kind, err)  # 1.2 with each rank's own mean
            # each rank reports its term of the combined batch's loss: their mean is torch's
            assert (got[0]["loss"] + got[1]["loss"]) / 2 == pytest.approx(expected_loss,
                                                                           rel=1e-12)


def _count_nodes(trainer: ngdist.Trainer) -> list:
    return [n for n in trainer.step_model.graph if n.name.startswith("ngdist/loss_count/")
            and n.op_type == "AllReduce"]


def test_the_count_is_one_scalar_allreduce_outside_buckets_and_compression():
    trainer = make_trainer("ignore", W0.astype(np.float32), CLASS_WEIGHTS, compression="fp16")
    (node,) = _count_nodes(trainer)
    assert node.attributes["reduction"].value == "mean"
    assert "compression" not in node.attributes and "bucket" not in node.attributes
    assert node.inputs[0].shape == ir.Shape([])
    names = [n.name for n in trainer.step_model.graph]
    before = names[:names.index(node.name)]
    # the count's nodes come first: the step meets the other ranks before its forward pass
    assert before and all(n.startswith("ngdist/loss_count/loss/") for n in before), before


def test_a_plain_mean_is_left_alone():
    trainer = ngdist.compile(zoo.mlp((6, 4, 5)), optimizer=ngdist.optim.SGD(lr=0.1))
    assert _count_nodes(trainer) == []


def test_a_counted_mean_inside_a_sum_of_losses_is_said_in_the_log(caplog):
    base = model("ignore", W0, CLASS_WEIGHTS)
    g = base.graph
    g.node[-1].output[0] = "ce"  # loss = ce + ce * ce: the mean is not the loss itself
    g.node.extend([helper.make_node("Mul", ["ce", "ce"], ["sq"]),
                   helper.make_node("Add", ["ce", "sq"], ["loss"])])
    with caplog.at_level(logging.WARNING, logger="ngdist.passes.losscount"):
        trainer = ngdist.compile(base, loss=None, optimizer=ngdist.optim.SGD(lr=1.0))
    assert _count_nodes(trainer) == []
    assert [r.getMessage() for r in caplog.records] == [
        "the loss 'loss' uses a mean over counted tokens inside other ops "
        "(SoftmaxCrossEntropyLoss 'sce'): each rank divides by its own count, so N ranks can "
        "differ from one process on the combined batch; make that mean the loss itself (or a "
        "Div by a count of the batch) to divide by the global count"]


def test_pushsum_keeps_each_rank_own_mean():
    trainer = make_trainer("ignore", W0, CLASS_WEIGHTS, strategy="pushsum")
    assert _count_nodes(trainer) == []
    assert any(n.op_type == "SoftmaxCrossEntropyLoss" and n.attributes["reduction"].value ==
               "mean" for n in trainer.step_model.graph)


def test_strategies_that_cannot_count_refuse():
    with pytest.raises(GraphError) as err:
        make_trainer("ignore", W0, CLASS_WEIGHTS, strategy="ps")
    assert str(err.value) == (
        "the loss 'loss' is a mean over the tokens it counts (SoftmaxCrossEntropyLoss node "
        "'sce'); the ps strategy cannot divide it by the count of the whole global batch (its "
        "shard owners may not run the forward pass): train with strategy='allreduce' or "
        "'simple', or write the loss as a sum divided by a fixed number")
    with pytest.raises(GraphError) as err:
        make_trainer("masked", W0, CLASS_WEIGHTS, reproducible_micro_batch=2)
    assert str(err.value) == (
        "the loss 'loss' is a mean over the tokens it counts (Div node 'masked_mean'); "
        "reproducible mode averages the losses of micro-batches, and a micro-batch's mean over "
        "its own counted tokens is not the global batch's: leave reproducible_micro_batch out, "
        "or write the loss as a sum divided by a fixed number")


def test_trained_class_weights_are_refused():
    with pytest.raises(GraphError) as err:
        ngdist.compile(model("weights", W0, CLASS_WEIGHTS), loss=None,
                       optimizer=ngdist.optim.SGD(lr=1.0))
    assert str(err.value) == (
        "the class weights 'cw' of the loss 'loss' are trained with the parameters: pass "
        "frozen=['cw'] (or params=) so that they stay fixed")


def test_evaluate_reads_the_loss_through_the_count():
    trainer = make_trainer("ignore", W0, CLASS_WEIGHTS)
    result = trainer.evaluate({"x": X, "y": Y})
    assert result.loss == pytest.approx(_torch_step("ignore")[1], rel=1e-12)
