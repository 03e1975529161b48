"""The PyTorch frontend's exporter fallback.

A mixture-of-experts layer with top-k routing (``torch.histc`` counts for the load-balancing
loss, ``F.one_hot`` gates, ``index_add_`` to combine the experts' outputs) exports with the
TorchScript exporter and ngdist's lent ``aten::histc`` symbolic; with its counts passed
through ``torch.special.erfcx`` (times 0: no TorchScript symbolic, lent or torch's) it fails
there and the dynamo exporter exports it, the frontend says so. Either way one step's loss and gradients, and three SGD steps, equal
torch's in float64 at several batch sizes (experts that get no token included). Asked for the dynamo exporter first, a
module with BatchNorm goes to the TorchScript exporter (the dynamo exporter drops training-mode
BatchNorm). When neither exporter can export, one GraphError carries both messages.
"""
from __future__ import annotations

import copy
import io
import logging

import numpy as np
import pytest
import torch

import ngdist
from ngdist.errors import GraphError
from ngdist.frontends import torch as tfront
from ngdist.frontends.torch_exporters import export_graph
from step_probe import check_step_graph, gradient_errors, max_rel_err, run_step

nn = torch.nn
F = nn.functional
D, E, K, CLASSES = 8, 4, 2, 3
TOL = 1e-4


class MoE(nn.Module):
    """Top-2 routing over 4 two-layer experts, a Switch-style load-balancing loss."""

    def __init__(self, counter: str = "histc") -> None:
        super().__init__()
        self.counter = counter
        self.norm = nn.LayerNorm(D)
        self.router = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(D, 16), nn.GELU(), nn.Linear(16, D)) for _ in range(E))
        self.out_norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x):
        h = self.norm(x)
        probs = self.router(h).softmax(-1)
        w, idx = probs.topk(K, dim=-1)
        w = w / w.sum(-1, keepdim=True)
        gate = (F.one_hot(idx, E).to(w.dtype) * w.unsqueeze(-1)).sum(1)  # [N, E]
        out = torch.zeros_like(h)
        for j, expert in enumerate(self.experts):
            tokens = (gate[:, j] > 0).nonzero().squeeze(-1)
            out.index_add_(0, tokens, expert(h[tokens]) * gate[tokens, j].unsqueeze(-1))
        if self.counter == "histc":
            counts = torch.histc(idx.to(h.dtype), bins=E, min=0, max=E - 1)
        else:
            counts = torch.stack([(idx == j).sum() for j in range(E)]).to(h.dtype)
            counts = counts + 0 * torch.special.erfcx(counts)  # no TorchScript symbolic
        balance = E * (counts / counts.sum() * probs.mean(0)).sum()
        return self.head(self.out_norm(out + x)), balance


class MoELoss(nn.Module):
    """Cross-entropy plus 0.01 of the load-balancing loss: forward returns the loss."""

    def __init__(self, counter: str = "histc") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.moe = MoE(counter)

    def forward(self, x, y):
        logits, balance = self.moe(x)
        return F.cross_entropy(logits, y) + 0.01 * balance


def _batch(n: int, seed: int):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, D)).astype(np.float32), rng.integers(0, CLASSES, n)


def _torch_grads(module: nn.Module, x, y):
    ref = copy.deepcopy(module).double()
    loss = ref(torch.from_numpy(x).double(), torch.from_numpy(y))
    loss.backward()
    return float(loss), {n: p.grad.numpy() for n, p in ref.named_parameters()}


def _experts_used(module: MoELoss, x) -> set[int]:
    with torch.no_grad():
        probs = module.moe.router(module.moe.norm(torch.from_numpy(x))).softmax(-1)
    return set(probs.topk(K, dim=-1)[1].flatten().tolist())


EXAMPLE = (torch.zeros(4, D), torch.zeros(4, dtype=torch.long))


def test_torch_alone_cannot_export_histc_with_the_lent_symbolic_it_can():
    with pytest.raises(torch.onnx.errors.UnsupportedOperatorError, match="aten::histc"):
        torch.onnx.export(MoELoss(), EXAMPLE, io.BytesIO(), dynamo=False, opset_version=18)
    model = export_graph("torchscript", MoELoss(), EXAMPLE, True, ["x", "y"], ["loss"], 18)
    assert "ReduceSum" in {n.op_type for n in model.graph.node}
    with pytest.raises(torch.onnx.errors.UnsupportedOperatorError, match="special_erfcx"):
        export_graph("torchscript", MoELoss("erfcx"), EXAMPLE, True, ["x", "y"],
                     ["loss"], 18)


@pytest.mark.parametrize("counter,exporter", [("histc", "torchscript"),
                                              ("erfcx", "dynamo")])
def test_moe_layer_gradients_match_torch(caplog, counter, exporter):
    module = MoELoss(counter)
    with caplog.at_level(logging.INFO, logger="ngdist.frontends"):
        model, exp = tfront.training_model(module, EXAMPLE, loss=None, optimizer="sgd:lr=0.01")
    assert exp.exporter == exporter
    if exporter == "dynamo":
        assert ("ngdist.frontends.torch_exporters", logging.WARNING,
                "exported MoELoss with the dynamo exporter (the torchscript exporter: "
                "UnsupportedOperatorError: Exporting the operator 'aten::special_erfcx' to ONNX "
                "opset version 18 is not supported)") in caplog.record_tuples
    assert set(exp.params) == {n for n, _ in module.named_parameters()}
    used = set()
    for n, seed in ((6, 0), (3, 1), (1, 2), (16, 3)):
        x, y = _batch(n, seed)
        used.add(len(_experts_used(module, x)))
        got = run_step(model, {"x": x, "y": y})
        loss, grads = _torch_grads(module, x, y)
        assert abs(float(got["loss"]) - loss) <= TOL * abs(loss), n
        errors = gradient_errors(got, grads)
        assert max(errors.values()) <= TOL, (n, errors)
    assert min(used) < E and max(used) == E  # some batches leave experts without tokens


@pytest.mark.parametrize("counter", ["histc", "erfcx"])
def test_moe_layer_trains_three_sgd_steps_like_torch(counter):
    module = MoELoss(counter)
    ref = copy.deepcopy(module).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    trainer = ngdist.compile(module, EXAMPLE, loss=None, strategy="local",
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.1,
                                                       momentum=0.9))
    check_step_graph(trainer.step_model)
    for n, seed in ((6, 4), (5, 5), (8, 6)):
        x, y = _batch(n, seed)
        trainer.step({"x": x, "y": y})
        ref_opt.zero_grad()
        ref(torch.from_numpy(x).double(), torch.from_numpy(y)).backward()
        ref_opt.step()
    trainer.to_torch()
    for (name, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        assert max_rel_err(mine.detach().numpy(), theirs.detach().numpy()) <= TOL, name


class WithBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn, self.head = nn.Linear(D, 6), nn.BatchNorm1d(6), nn.Linear(6, CLASSES)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.fc(x))))


def test_dynamo_first_hands_a_batchnorm_module_to_the_torchscript_exporter(caplog):
    with caplog.at_level(logging.INFO, logger="ngdist.frontends"):
        exp = tfront.export(WithBatchNorm(), torch.zeros(4, D), exporter="dynamo")
    assert exp.exporter == "torchscript"
    assert ("ngdist.frontends.torch_exporters", logging.WARNING,
            "exported WithBatchNorm with the torchscript exporter (the dynamo exporter: "
            "GraphError: BatchNorm1d 'bn' keeps running statistics, which the dynamo exporter "
            "drops from a training-mode graph)") in caplog.record_tuples
    bn = [n for n in exp.train.graph.node if n.op_type == "BatchNormalization"]
    assert len(bn) == 1 and {a.name: a.i for a in bn[0].attribute}["training_mode"] == 1


class Unexportable(nn.Module):
    """torch.special.erfcx (no TorchScript symbolic) and a branch on a value (no torch.export
    guard)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, CLASSES)

    def forward(self, x):
        counts = torch.special.erfcx((x > 0).sum(0).to(x.dtype))
        return self.fc(x) * counts[int(x.sum().item() > 0)]


def test_when_both_exporters_fail_one_error_carries_both_messages():
    with pytest.raises(GraphError) as info:
        ngdist.compile(Unexportable(), torch.zeros(4, D), strategy="local",
                       optimizer="sgd:lr=0.01")
    assert str(info.value) == (
        "torch.onnx.export cannot export Unexportable: the torchscript exporter: "
        "UnsupportedOperatorError: Exporting the operator 'aten::special_erfcx' to ONNX opset "
        "version 18 is not supported; the dynamo exporter: GuardOnDataDependentSymNode: Could not "
        "guard on data-dependent expression zuf0 > 0.0 (unhinted: zuf0 > 0.0).  (Size-like "
        "symbols: none). Rewrite the unsupported operation or compile an ONNX file you "
        "exported yourself")
    assert info.value.__cause__ is None and info.value.__context__ is None


def test_an_unknown_exporter_is_refused():
    with pytest.raises(ValueError, match=r"exporter must be one of \('torchscript', "
                                         r"'dynamo'\); got 'jit'"):
        tfront.export(WithBatchNorm(), torch.zeros(4, D), exporter="jit")


class FlatTokenLoss(nn.Module):
    """A causal LM's loss over flattened tokens: labels hold T - 1 rows per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(CLASSES + 2, D), nn.Linear(D, CLASSES + 2)

    def forward(self, ids, labels):
        logits = self.head(self.emb(ids))[:, :-1].reshape(-1, CLASSES + 2)
        return F.cross_entropy(logits, labels)


class StarArgs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, CLASSES)

    def forward(self, *args):
        x, y = args
        return F.cross_entropy(self.lin(x), y)


def _tokens(n: int, t: int, seed: int):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, CLASSES + 2, (n, t))
    return ids, ids[:, 1:].reshape(-1)


def test_dynamo_keeps_each_inputs_batch_size_its_own():
    """Labels of T - 1 rows per sequence export and differentiate at other batch sizes."""
    module = FlatTokenLoss()
    ids, labels = _tokens(3, 8, 0)
    model, exp = tfront.training_model(module, (torch.from_numpy(ids), torch.from_numpy(labels)),
                                       loss=None, exporter="dynamo", input_names=["x", "y"],
                                       optimizer="sgd:lr=0.01")
    assert exp.exporter == "dynamo"
    for n, seed in ((5, 1), (2, 2)):
        ids, labels = _tokens(n, 8, seed)
        got = run_step(model, {"x": ids, "y": labels})
        ref = copy.deepcopy(module).double()
        loss = ref(torch.from_numpy(ids), torch.from_numpy(labels))
        loss.backward()
        grads = {k: p.grad.numpy() for k, p in ref.named_parameters()}
        assert abs(float(got["loss"]) - float(loss)) <= TOL * abs(float(loss)), n
        assert max(gradient_errors(got, grads).values()) <= TOL, n


def test_dynamo_exports_a_forward_of_star_args():
    x, y = _batch(4, 0)
    model = export_graph("dynamo", StarArgs(), (torch.from_numpy(x), torch.from_numpy(y)),
                         True, ["x", "y"], ["loss"], 18)
    assert [i.name for i in model.graph.input][:2] == ["x", "y"]


class AudioLM(nn.Module):
    """Token ids, a feature map whose per-sample frame count scales the embeddings (a 1-D
    tensor of one entry per sample) and flattened-token labels of T - 1 rows per sample: the
    loss is the module's own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.mix = nn.Embedding(11, D), nn.Linear(D, D)
        self.head = nn.Linear(D, 11)

    def forward(self, ids, feats, labels):
        frames = (feats[:, :, 0] > -9).sum(1).to(feats.dtype) / feats.shape[1]
        h = self.emb(ids) * frames[:, None, None] + self.mix(feats).mean(1, keepdim=True)
        logits = self.head(torch.tanh(h))[:, :-1]
        return F.cross_entropy(logits.reshape(-1, 11), labels, ignore_index=-100)


def test_inputs_of_other_row_counts_are_not_declared_the_batchs_size():
    """onnxruntime takes inputs declared with one symbolic size to have one size, and its
    memory planner reused the buffer of a [batch] tensor for the [batch * (T - 1)] labels'
    gradient mask ("Shape mismatch attempting to re-use buffer. {3} != {15}")."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 11, (3, 6))
    feats = rng.standard_normal((3, 4, D)).astype(np.float32)
    labels = ids[:, 1:].reshape(-1).copy()
    labels[-2:] = -100
    module = AudioLM()
    example = tuple(torch.from_numpy(a) for a in (ids, feats, labels))
    model, _ = tfront.training_model(module, example, loss=None, optimizer="sgd:lr=0.1",
                                     input_names=["ids", "feats", "labels"])
    dims = {i.name: i.type.tensor_type.shape.dim[0].dim_param for i in model.graph.input
            if i.name in ("ids", "feats", "labels")}
    assert dims == {"ids": "batch", "feats": "batch", "labels": "labels_rows"}
    got = run_step(model, {"ids": ids, "feats": feats, "labels": labels})
    ref = copy.deepcopy(module).double()
    loss = ref(torch.from_numpy(ids), torch.from_numpy(feats).double(),
               torch.from_numpy(labels))
    loss.backward()
    assert abs(float(got["loss"]) - float(loss)) <= 1e-6
    errors = gradient_errors(got, {n: p.grad.numpy() for n, p in ref.named_parameters()})
    assert max(errors.values()) <= 1e-5, errors


class TiedLM(nn.Module):
    """A decoder whose output projection is its embedding (registered second, as Hugging
    Face's proj_out / lm_head): state_dict holds the tensor under both names."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = nn.Embedding(11, D)
        self.mix = nn.Linear(D, D)
        self.proj_out = nn.Linear(D, 11, bias=False)
        self.proj_out.weight = self.embed_tokens.weight

    def forward(self, ids):
        return self.proj_out(torch.tanh(self.mix(self.embed_tokens(ids)))).mean(1)


@pytest.mark.parametrize("exporter", ["dynamo", "torchscript"])
def test_a_tied_weight_is_trained_under_its_parameter_name_by_either_exporter(exporter):
    ids = np.random.default_rng(0).integers(0, 11, (4, 5))
    y = np.array([1, 0, 3, 2])
    module = TiedLM()
    model, exp = tfront.training_model(module, (torch.from_numpy(ids),), exporter=exporter,
                                       loss=nn.CrossEntropyLoss(), optimizer="sgd:lr=0.1",
                                       input_names=["ids"])
    assert exp.exporter == exporter
    assert set(exp.params) == {n for n, _ in module.named_parameters()}
    got = run_step(model, {"ids": ids, "y": y})
    ref = copy.deepcopy(module).double()
    F.cross_entropy(ref(torch.from_numpy(ids)), torch.from_numpy(y)).backward()
    errors = gradient_errors(got, {n: p.grad.numpy() for n, p in ref.named_parameters()})
    assert max(errors.values()) <= 1e-5, errors
