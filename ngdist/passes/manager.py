"""The pass manager of ngdist's pipelines, and the requirements a pass declares.

As onnx_ir's ``PassBase.requires``: a pass states what the graph must be for it to apply, in
its ``requires``, instead of testing it at the top of ``call``. A requirement that is not met
raises :class:`Unmet` (an onnx_ir ``PreconditionError``); :class:`StepPassManager` then leaves
that pass out, with a log line naming the pass and why, and runs the next one. Any other
failure of a requirement fails the pipeline, as in onnx_ir's own PassManager.

:class:`CommInsertionPass` is the requirement of the strategies' comm passes (AllReduce,
PSPushPull, PushSum, CentralReduce insertion): a graph that already holds comm ops (a model
rewritten before, or with comm nodes of its own) is left as it is, so rewriting a rewritten
model keeps its comm nodes and buckets.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import onnx_ir as ir

from ngdist.errors import GraphError
from ngdist.passes.analysis import comm_nodes

logger = logging.getLogger(__name__)


class Unmet(ir.passes.PreconditionError, GraphError):
    """A requirement of a pass that the graph does not meet: the pass does not apply (a
    GraphError where the pass is run on its own, outside :class:`StepPassManager`)."""


class CommInsertionPass(ir.passes.InPlacePass):
    """A pass that inserts a strategy's comm ops: it requires a graph without any."""

    def requires(self, model: ir.Model) -> None:
        found = comm_nodes(model)
        if found:
            raise Unmet(f"{type(self).__name__} left out: the graph already holds "
                        f"{len(found)} comm op(s) ({found[0].op_type} '{found[0].name}', ...)")


class StepPassManager(ir.passes.PassManager):
    """Runs ``passes`` once, in order; a pass whose requirement is :class:`Unmet` is left out
    (logged), any other failure is raised as onnx_ir's ``PassError`` from its cause."""

    def __init__(self, passes: Sequence[ir.passes.PassBase]) -> None:
        super().__init__(passes, steps=1)

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        modified = False
        for i, pass_ in enumerate(self.passes):
            try:
                result = pass_(model)
            except Unmet as why:
                logger.info("%s", why)
                continue
            except Exception as exc:
                raise ir.passes.PassError(
                    f"An error occurred when running the '{pass_}' pass after the following "
                    f"passes: {[str(p) for p in self.passes[:i]]}") from exc
            model = result.model
            modified = modified or result.modified
        return ir.passes.PassResult(model, modified)
