"""The graph's shapes are probed with the example batch, cycled to each probe batch size, at
every fold (the export's and the training model's): inputs made up from the declared types
(zeros for indices and masks) can drive a model into values it never meets (an empty
selection, a count of zero) on which onnxruntime fails, or dies of SIGFPE (Longformer: no
token with global attention). A graph that runs at the example's batch size only (a size
traced as a constant, Longformer's ``len(nonzero)``) is said so by name. torch's ``unbind``
pieces are 1-D for shape inference as they are in onnxruntime."""
from __future__ import annotations

import logging

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator
from step_probe import gradient_errors, run_step

from ngdist.frontends import torch as tfront
from ngdist.frontends.cleanup import squeezing_splits

LOGGER = "ngdist.frontends.shape_probes"


class GlobalRows(torch.nn.Module):
    """Longformer's pattern in small: the rows of the tokens with global attention (the
    first of each kept sample) viewed to ``len()`` of their indices, a constant in the trace;
    and a per-sample integer scale that divides by the kept-token count."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        scale = torch.div(mask.shape[1], mask.sum(1, keepdim=True), rounding_mode="floor")
        index = mask[:, 0].nonzero()
        rows = h[index[:, 0], 0].reshape(len(index), -1)
        return self.lin(h.mean(1) * scale.float() + rows)


def _example() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randint(0, 10, (3, 6), generator=gen), torch.ones(3, 6, dtype=torch.int64),
            torch.randint(0, 3, (3,), generator=gen))


def test_training_model_probes_with_the_example_batch(caplog):
    ids, mask, y = _example()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        tfront.training_model(GlobalRows(), (ids, mask), loss=torch.nn.CrossEntropyLoss(),
                              input_names=["ids", "mask"], optimizer="sgd:lr=0.1")
    warned = [m for name, _, m in caplog.record_tuples if name == LOGGER]
    assert warned, "the graph runs at batch 3 only: its probes at 4 and 7 must say so"
    for message in warned:  # zeros for the mask would divide by zero (Integer division)
        assert message.startswith("the exported graph does not run at a batch of 4 ("), message
        assert message.endswith("traced from the example batch (len(tensor) or int(...) of a "
                                "size in the module), so it trains only at the batch sizes "
                                "where it runs; shape folding skipped"), message


def test_graph_traced_at_the_example_batch_trains_like_torch():
    """The compiled step at the example's batch gives torch's gradients (float64 oracle)."""
    ids, mask, y = _example()
    module = GlobalRows()
    model, exp = tfront.training_model(module, (ids, mask), loss=torch.nn.CrossEntropyLoss(),
                                       input_names=["ids", "mask"], optimizer="sgd:lr=0.1")
    got = run_step(model, {"ids": ids.numpy(), "mask": mask.numpy(), "y": y.numpy()})
    ref = module.double()
    loss = torch.nn.functional.cross_entropy(ref(ids, mask), y)
    loss.backward()
    exact = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert set(exact) <= set(exp.params)
    assert max(gradient_errors(got, exact).values()) < 1e-5
    assert abs(float(got["loss"]) - loss.item()) < 1e-5



def _split_model(split: np.ndarray) -> onnx.ModelProto:
    """torch's ``unbind`` of [n, 2] along axis 1: SplitToSequence(split, keepdims=0), piece 0."""
    nodes = [helper.make_node("SplitToSequence", ["x", "split"], ["pieces"], axis=1,
                              keepdims=0),
             helper.make_node("SequenceAt", ["pieces", "zero"], ["y"])]
    graph = helper.make_graph(
        nodes, "unbind", [helper.make_tensor_value_info("x", TensorProto.INT64, ["n", 2])],
        [helper.make_tensor_value_info("y", TensorProto.INT64, None)],
        [numpy_helper.from_array(split, "split"),
         numpy_helper.from_array(np.array(0, np.int64), "zero")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)],
                             ir_version=8)


def _inferred_rank(model: onnx.ModelProto) -> int:
    out = onnx.shape_inference.infer_shapes(model).graph.output[0]
    return len(out.type.tensor_type.shape.dim)


def test_unbind_pieces_are_one_dimensional_in_shape_inference_as_in_onnxruntime():
    """torch's ``unbind`` (``nonzero(as_tuple=True)``: Longformer's global-attention indices)
    exports as SplitToSequence with a scalar split of 1 and keepdims 0: onnxruntime gives
    1-D pieces, shape inference (the ONNX spec ignores keepdims where split is given) 2-D
    ones, and the passes' shapes planned from it broadcast the step's scatter indices to
    [n, n, 2]. Without the split input both give 1-D pieces."""
    x = np.arange(6, dtype=np.int64).reshape(3, 2)
    model = _split_model(np.array(1, np.int64))
    assert _inferred_rank(model) == 2
    before = ort.InferenceSession(model.SerializeToString(),
                                  providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert squeezing_splits(model) == 1
    assert list(model.graph.node[0].input) == ["x"]
    assert _inferred_rank(model) == 1
    after = ort.InferenceSession(model.SerializeToString(),
                                 providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert before.tobytes() == after.tobytes() and after.shape == (3,)
    assert ReferenceEvaluator(model).run(None, {"x": x})[0].shape == (3,)
    for split in (np.array([1, 1], np.int64), np.array(2, np.int64)):  # sizes of their own
        assert squeezing_splits(_split_model(split)) == 0



class RepeatedKeys(torch.nn.Module):
    """Keys repeated along the sequence (``repeat``: Expand(x, ConstantOfShape(Shape(r)))
    then Tile), next to a view of a size traced from the example batch, which keeps the
    graph's shapes computed (folding skipped): the rank of the repeated keys comes from
    propagating the Shape's value only (jetmoe's attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.q = torch.nn.Linear(4, 4)
        self.k = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).view(len(x), 3, 4)
        k = self.k(x).repeat(1, 2, 1)
        return (q @ k.transpose(1, 2)).mean(1)


def test_repeat_in_a_graph_traced_at_the_example_batch_trains_like_torch():
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(3, 3, 4, generator=gen), torch.randint(0, 6, (3,), generator=gen)
    module = RepeatedKeys()
    model, exp = tfront.training_model(module, (x,), loss=torch.nn.CrossEntropyLoss(),
                                       input_names=["x"], optimizer="sgd:lr=0.1")
    got = run_step(model, {"x": x.numpy(), "y": y.numpy()})
    ref = module.double()
    loss = torch.nn.functional.cross_entropy(ref(x.double()), y)
    loss.backward()
    exact = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    assert set(exact) <= set(exp.params)
    assert max(gradient_errors(got, exact).values()) < 1e-5
    assert abs(float(got["loss"]) - loss.item()) < 1e-5
