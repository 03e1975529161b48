"""The pass manager's requirements: a comm pass requires a graph without comm ops; the manager
leaves a pass whose requirement is unmet out (logged) and fails on any other broken one."""
from __future__ import annotations

import logging

import onnx_ir as ir
import pytest

import ngdist
from ngdist import zoo
from ngdist.ir.domain import DOMAIN
from ngdist.ir.model import split_training_model
from ngdist.passes.allreduce import AllReduceInsertionPass
from ngdist.passes.manager import CommInsertionPass, StepPassManager, Unmet
from ngdist.passes.pipeline import rewrite
from ngdist.passes.ps import PSPushPullPass
from ngdist.passes.pushsum import PushSumPass
from ngdist.passes.simple import CentralReducePass

COMM_PASSES = [AllReduceInsertionPass(), PSPushPullPass(), PushSumPass(), CentralReducePass()]


def _training():
    return ngdist.to_training_model(zoo.mlp((8, 6, 3), seed=0),
                                    optimizer=ngdist.optim.SGD(lr=0.1))


def _comm_ops(step: ir.Model) -> list[str]:
    return [n.name for n in step.graph if n.domain == DOMAIN]


class _Marks(ir.passes.InPlacePass):
    """Records that it ran."""

    def __init__(self) -> None:
        super().__init__()
        self.ran = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        self.ran += 1
        return ir.passes.PassResult(model, False)


@pytest.mark.parametrize("comm_pass", COMM_PASSES, ids=lambda p: type(p).__name__)
def test_every_comm_pass_requires_a_graph_without_comm_ops(comm_pass):
    assert isinstance(comm_pass, CommInsertionPass)
    _, plain = split_training_model(_training())
    comm_pass.requires(plain)  # met: nothing raised
    _, rewritten = split_training_model(rewrite(_training(), "allreduce"))
    first = next(n for n in rewritten.graph if n.domain == DOMAIN)
    with pytest.raises(Unmet, match=rf"^{type(comm_pass).__name__} left out: the graph already "
                                    rf"holds \d+ comm op\(s\) \({first.op_type} "
                                    rf"'{first.name}', \.\.\.\)$"):
        comm_pass.requires(rewritten)


def test_the_manager_leaves_an_unmet_pass_out_and_runs_the_next(caplog):
    _, rewritten = split_training_model(rewrite(_training(), "allreduce"))
    before = _comm_ops(rewritten)
    marks = _Marks()
    with caplog.at_level(logging.INFO, logger="ngdist.passes.manager"):
        result = StepPassManager([AllReduceInsertionPass(), marks])(rewritten)
    assert _comm_ops(result.model) == before and not result.modified
    assert marks.ran == 1
    assert [r.getMessage().split(":")[0] for r in caplog.records] == \
        ["AllReduceInsertionPass left out"]


def test_the_manager_fails_on_a_requirement_that_is_broken_not_unmet():
    class Broken(_Marks):
        def requires(self, model: ir.Model) -> None:
            raise KeyError("no such value")

    _, plain = split_training_model(_training())
    after = _Marks()
    with pytest.raises(ir.passes.PassError) as info:
        StepPassManager([Broken(), after])(plain)
    assert isinstance(info.value.__cause__, ir.passes.PreconditionError)
    assert after.ran == 0


def test_rewriting_a_rewritten_model_keeps_its_comm_ops():
    once = rewrite(_training(), "allreduce")
    twice = rewrite(once, "allreduce")
    names = [[(n.name, n.op_type) for n in m.training_info[0].algorithm.node
              if n.domain == DOMAIN] for m in (once, twice)]
    assert names[0] and names[0] == names[1]
