"""A Trainer's current parameters used for inference: the inference model with them, its
predictions, and evaluate(): validation loss and accuracy over a data set, sharded over the
training ranks. Sessions are built once per step count and extra output."""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper

from ngdist.comm import ProcessGroup
from ngdist.errors import InputError
from ngdist.ir.model import StepMeta
from ngdist.runtime.batch_checks import check_label_values, check_same_size, leaf_sizes, np_type
from ngdist.runtime.metrics import Evaluation, MetricsLog, eval_loss, loss_terms
from ngdist.runtime.sessions import Placement, make_session


class Inference:
    """The Trainer's inference graph run with its current values."""

    inference: onnx.ModelProto
    step_model: ir.Model
    meta: StepMeta
    placement: Placement
    data_inputs: dict[str, onnx.ValueInfoProto]
    steps_done: int
    epoch: int | None
    metrics: MetricsLog | None
    stats_group: ProcessGroup | None
    _model_inputs: list[str]
    _label_checks: dict[str, tuple[str, int | None, int | None]]
    _sessions: tuple[int, dict[str | None, ort.InferenceSession]]
    _deployable: Callable[[], dict[str, np.ndarray]]  # the values as deployed (runtime/state.py)

    def evaluate(self, data: Mapping[str, Any], batch_size: int = 1024) -> Evaluation:
        """Validation loss and accuracy of the current parameters on ``data`` (the whole
        set, the same on every rank: input arrays and the labels). Collective over the training
        ranks: each evaluates its ``np.array_split`` shard with the inference graph, and the
        sums of per-sample losses and of correct predictions over the ranks are divided by the
        total count, so the result is the whole set's (on every rank). The loss is the
        training loss's formula (softmax_cross_entropy: mean over the samples that are not
        ``ignore_index``; mse: mean over all elements); accuracy (arg-max over axis 1 equal
        to the label) only for softmax_cross_entropy. With ``log_dir`` the result is logged
        as a ``val`` row. A dedicated parameter-server rank evaluates the whole set alone."""
        kind, scores, labels, ignore = eval_loss(self.step_model, self.meta.loss,
                                                  self.data_inputs, self._label_checks)
        needed = [*self._model_inputs, labels]
        missing = [n for n in needed if n not in data]
        if missing:
            raise InputError(f"evaluate() needs arrays {needed}; {missing} missing")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"evaluate(batch_size={batch_size!r}): give a whole number of "
                             "samples, at least 1")
        sizes = leaf_sizes({n: data[n] for n in needed})
        check_same_size(sizes, "the validation data")
        group = self.stats_group
        shard = {n: np.asarray(data[n]) if group is None else
                 np.array_split(np.asarray(data[n]), group.size)[group.rank] for n in needed}
        sess = self._inference_session(scores)
        totals = np.zeros(3, np.float64)  # loss sum, correct, counted (samples or elements)
        count = next(iter(sizes.values()), 0)
        local = len(shard[labels])
        for i in range(0, local, batch_size):
            feeds = {n: np.ascontiguousarray(shard[n][i:i + batch_size], dtype=np_type(
                self.data_inputs[n])) for n in self._model_inputs}
            logits = np.asarray(sess.run([scores], feeds)[0], np.float64)
            y = shard[labels][i:i + batch_size]
            if kind == "softmax_cross_entropy":  # class ids in range, as a step checks them
                check_label_values(labels, y, None, scores, ignore, None)
                check_label_values(labels, y, y.astype(np.int64), scores, ignore,
                                    logits.shape[1])
            totals += loss_terms(kind, logits, y, ignore)
        if group is not None and group.size > 1:
            group.allreduce(totals, "evaluate(): loss and correct counts").wait()
        loss_sum, correct, counted = totals
        loss_sum, correct, counted = float(loss_sum), float(correct), float(counted)
        result = Evaluation(loss=loss_sum / counted if counted else float("nan"),
                            accuracy=(correct / counted if counted else float("nan"))
                            if kind == "softmax_cross_entropy" else None, samples=count)
        if self.metrics is not None:
            self.metrics.validation(self.steps_done, self.epoch, result)
        return result

    def _inference_session(self, output: str | None = None) -> ort.InferenceSession:
        """A session of the inference graph with the current values; ``output`` (a value of
        the step graph, e.g. the scores of the loss) is added as an output if the model does
        not have it."""
        if self._sessions[0] != self.steps_done:
            self._sessions = (self.steps_done, {})
        sessions = self._sessions[1]
        if output in {o.name for o in self.inference.graph.output}:
            output = None  # the model's own session has it
        if output not in sessions:
            model = self.inference_model()
            if output is not None:
                dtype = next((o.dtype for n in self.step_model.graph for o in n.outputs
                              if o.name == output and o.dtype is not None), None)
                model.graph.output.append(onnx.helper.make_tensor_value_info(
                    output, int(dtype) if dtype is not None else onnx.TensorProto.FLOAT, None))
            sessions[output] = make_session(model, self.placement)
        return sessions[output]

    def inference_model(self) -> onnx.ModelProto:
        model = copy.deepcopy(self.inference)
        values = self._deployable()
        for t in model.graph.initializer:
            if t.name in values:
                t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
        return model

    def predict(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs the inference graph with the current parameters."""
        return self._inference_session().run(None, dict(inputs))
