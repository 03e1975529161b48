"""PyTorch's optimizer formulas: torch.optim.Adam, AdamW and SGD with dampening train exactly
as torch does (3 float32 steps, parameters within 1e-4 relative), on a model whose scaled
biases have gradients of ~1e-7 at initialization, where ONNX's Adam (epsilon added before the
bias correction) differs; ngdist.optim.AdamW against a numpy oracle, also across save/load.
Every other torch optimizer, parameter groups and schedulers: test_torch_optim_formulas.py."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import torch  # noqa: E402
nn = torch.nn

import ngdist  # noqa: E402
from ngdist.errors import OptionError  # noqa: E402
from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import max_rel_err  # noqa: E402

BIAS_SCALE = 1e-6  # the last layer's bias enters as bias * 1e-6: its gradient is ~1e-7


pytestmark = pytest.mark.usefixtures("one_torch_thread")


class ScaledBiasLinear(nn.Module):
    """A linear layer whose bias gradient is tiny at initialization, as transformer biases'
    are (ONNX Adam and torch Adam differ most there)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.inner = nn.Linear(n_in, n_out)

    def forward(self, x):
        return nn.functional.linear(x, self.inner.weight, self.inner.bias * BIAS_SCALE)


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(),
                         ScaledBiasLinear(32, 4))


def batches():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8, 16)).astype(np.float32)
    y = rng.integers(0, 4, (3, 8)).astype(np.int64)
    return list(zip(x, y))


def train_torch(make_opt):
    ref = make_model()
    opt = make_opt(ref.parameters())
    for xb, yb in batches():
        opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
        opt.step()
    return ref, opt


def train_ngdist(optimizer_for):
    module = make_model()
    trainer = ngdist.compile(module, torch.zeros(2, 16), loss=nn.CrossEntropyLoss(),
                             optimizer=optimizer_for(module), strategy="local")
    for xb, yb in batches():
        trainer.step({"input": xb, "y": yb})
    trainer.to_torch()  # the trained parameters into module
    return module, trainer


TORCH_OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_l2": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.8, 0.99), weight_decay=1e-3),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.01),
    # a small beta2 lets v fall below its running maximum within 3 steps
    "adam_amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, betas=(0.5, 0.1), amsgrad=True),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.2),
                                                  weight_decay=0.01, amsgrad=True),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1,
                                                weight_decay=1e-4),
    # the other formulas in float32 too (float64, groups and maximize:
    # test_torch_optim_formulas.py)
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.05, initial_accumulator_value=0.1),
    "rmsprop_centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-3, centered=True,
                                                       momentum=0.9),
    "adadelta": lambda ps: torch.optim.Adadelta(ps, lr=1.0, weight_decay=1e-3),
    "adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "nadam": lambda ps: torch.optim.NAdam(ps, lr=1e-2, weight_decay=1e-3),
    "radam": lambda ps: torch.optim.RAdam(ps, lr=1e-2, betas=(0.9, 0.5)),
}


def test_scaled_bias_gradients_are_tiny_at_init():
    module = make_model()
    xb, yb = batches()[0]
    nn.functional.cross_entropy(module(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
    grad = module[3].inner.bias.grad.abs().max().item()
    assert 1e-9 < grad < 1e-6


@pytest.mark.parametrize("name", sorted(TORCH_OPTIMIZERS))
def test_torch_optimizer_is_followed_exactly_and_state_written_back(name):
    make_opt = TORCH_OPTIMIZERS[name]
    ref, ref_opt = train_torch(make_opt)
    if "amsgrad" in name:  # the maximum is in effect somewhere
        assert any(not torch.equal(st["max_exp_avg_sq"], st["exp_avg_sq"])
                   for st in ref_opt.state.values())
    module, trainer = train_ngdist(lambda m: make_opt(m.parameters()))
    user_opt = make_opt(module.parameters())
    trainer.to_torch(optimizer=user_opt)
    for (pname, mine), theirs, before in zip(module.named_parameters(), ref.parameters(),
                                             make_model().parameters()):
        mine, theirs, before = (t.detach().numpy() for t in (mine, theirs, before))
        assert max_rel_err(mine, theirs) <= 1e-4, pname
        assert max_rel_err(mine - before, theirs - before) <= 1e-4, pname  # the updates too
    for mine, theirs in zip(module.parameters(), ref.parameters()):
        state, ref_state = user_opt.state[mine], ref_opt.state[theirs]
        for key in ref_state:
            if key != "step":
                assert max_rel_err(state[key].numpy(), ref_state[key].numpy()) <= 1e-4, key
        assert set(state) == set(ref_state)
        if "step" in ref_state:
            assert float(state["step"]) == float(ref_state["step"]) == 3.0
    # the written-back state continues training as torch's own would
    xb, yb = batches()[0]
    for m, o in ((module, user_opt), (ref, ref_opt)):
        o.zero_grad()
        nn.functional.cross_entropy(m(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
        o.step()
    for (pname, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        assert max_rel_err(mine.detach().numpy(), theirs.detach().numpy()) <= 1e-4, pname


def test_translation_picks_the_torch_formulas():
    ps = list(make_model().parameters())
    assert tfront.translate_optimizer(torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-3)) == \
        ngdist.optim.TorchAdam(lr=1e-2, weight_decay=1e-3)
    assert tfront.translate_optimizer(torch.optim.AdamW(ps, lr=1e-2)) == \
        ngdist.optim.AdamW(lr=1e-2, weight_decay=0.01)
    assert tfront.translate_optimizer(torch.optim.SGD(ps, lr=0.1, momentum=0.9,
                                                      dampening=0.1)) == \
        ngdist.optim.SGD(lr=0.1, momentum=0.9, dampening=0.1)
    assert tfront.translate_optimizer(torch.optim.AdamW(ps, amsgrad=True)) == \
        ngdist.optim.AdamW(amsgrad=True)


def test_onnx_adam_differs_on_tiny_bias_gradients():
    """The same hyper-parameters with ONNX's Adam formula: the scaled bias is measurably off
    torch.optim.Adam, which is why torch.optim.Adam is not translated to it."""
    ref, _ = train_torch(TORCH_OPTIMIZERS["adam"])
    onnx_adam, _ = train_ngdist(lambda m: ngdist.optim.Adam(lr=1e-2))
    torch_adam, _ = train_ngdist(lambda m: ngdist.optim.TorchAdam(lr=1e-2))
    want = ref[3].inner.bias.detach().numpy()
    assert max_rel_err(torch_adam[3].inner.bias.detach().numpy(), want) <= 1e-4
    assert max_rel_err(onnx_adam[3].inner.bias.detach().numpy(), want) > 1e-2
    # where gradients are large the two formulas agree closely
    assert max_rel_err(onnx_adam[0].weight.detach().numpy(),
                       ref[0].weight.detach().numpy()) <= 1e-3


# --------------------------------------------------------------------------- numpy oracle

def mlp_forward_model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for n, a in [
        ("W1", rng.standard_normal((6, 10)) * 0.5), ("b1", rng.standard_normal(10) * 0.1),
        ("W2", rng.standard_normal((10, 3)) * 0.5), ("b2", rng.standard_normal(3) * 0.1)]]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]),
             helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("Relu", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["o0"]),
             helper.make_node("Add", ["o0", "b2"], ["out"])]
    graph = helper.make_graph(
        nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def mlp_grads(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of mean((out - y)^2) over every element, in float64."""
    h = x @ p["W1"] + p["b1"]
    a = np.maximum(h, 0)
    d_out = 2 * (a @ p["W2"] + p["b2"] - y) / y.size
    dh = (d_out @ p["W2"].T) * (h > 0)
    return {"W1": x.T @ dh, "b1": dh.sum(0), "W2": a.T @ d_out, "b2": d_out.sum(0)}


def adamw_oracle(p, batches_, lr, betas, eps, wd):
    """torch.optim.AdamW's formula in float64."""
    p = {k: v.astype(np.float64) for k, v in p.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(v) for k, v in p.items()}
    b1, b2 = betas
    for t, (x, y) in enumerate(batches_, start=1):
        g = mlp_grads(p, x.astype(np.float64), y.astype(np.float64))
        for k in p:
            p[k] = p[k] * (1 - lr * wd)
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            denom = np.sqrt(v[k]) / np.sqrt(1 - b2 ** t) + eps
            p[k] = p[k] - lr / (1 - b1 ** t) * m[k] / denom
    return p, m, v


def test_ngdist_adamw_matches_a_numpy_oracle_across_save_and_load(tmp_path):
    forward = mlp_forward_model()
    init = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    rng = np.random.default_rng(2)
    data = [(rng.standard_normal((8, 6)).astype(np.float32),
             rng.standard_normal((8, 3)).astype(np.float32)) for _ in range(3)]
    opt = ngdist.optim.AdamW(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    want, want_m, want_v = adamw_oracle(init, data, 0.05, (0.8, 0.95), 1e-6, 0.1)

    model = ngdist.to_training_model(forward, loss="mse", optimizer=opt)
    marked = [n for n in model.training_info[0].algorithm.node if n.op_type == "Adam"]
    assert [a.s for n in marked for a in n.attribute if a.name == "ngdist_formula"] == \
        [b"torch_adamw"]
    trainer = ngdist.compile(model, strategy="local")
    trainer.step({"x": data[0][0], "y": data[0][1]})
    trainer.step({"x": data[1][0], "y": data[1][1]})
    path = tmp_path / "adamw.onnx"
    trainer.save(path)
    resumed = ngdist.compile(path, strategy="local")  # the formula and step count survive
    resumed.step({"x": data[2][0], "y": data[2][1]})
    got = resumed.state_dict()
    assert int(got["ngdist.step"]) == 3
    for k in want:
        assert max_rel_err(got[k], want[k]) <= 1e-4, k
        assert max_rel_err(got[f"{k}.adam_m"], want_m[k]) <= 1e-4, k
        assert max_rel_err(got[f"{k}.adam_v"], want_v[k]) <= 1e-4, k
    # ONNX's Adam with the same numbers is another optimizer: it has no decoupled decay
    onnx_adam = ngdist.compile(forward, loss="mse", optimizer=ngdist.optim.Adam(
        lr=0.05, betas=(0.8, 0.95), eps=1e-6), strategy="local")
    for x, y in data:
        onnx_adam.step({"x": x, "y": y})
    assert max(max_rel_err(onnx_adam.state_dict()[k], want[k]) for k in want) > 1e-3


def test_optimizer_specs_name_the_torch_formulas():
    assert ngdist.optim.from_spec("adamw:lr=1e-3,weight_decay=0.05") == \
        ngdist.optim.AdamW(lr=1e-3, weight_decay=0.05)
    assert ngdist.optim.from_spec("torch_adam:lr=1e-3,betas=0.8/0.9") == \
        ngdist.optim.TorchAdam(lr=1e-3, betas=(0.8, 0.9))
    assert ngdist.optim.from_spec("adamw:amsgrad=true").state_suffixes == \
        ("adam_m", "adam_v", "adam_vmax")
    assert ngdist.optim.from_spec("sgd:lr=0.1,momentum=0.9,dampening=0.5") == \
        ngdist.optim.SGD(lr=0.1, momentum=0.9, dampening=0.5)
    with pytest.raises(OptionError, match="dampening 0"):
        ngdist.optim.SGD(momentum=0.9, nesterov=True, dampening=0.1)
    assert ngdist.optim.from_spec("rmsprop:lr=0.1,centered=true,momentum=0.5") == \
        ngdist.optim.RMSprop(lr=0.1, centered=True, momentum=0.5)
    assert ngdist.optim.from_spec("nadam:decoupled_weight_decay=1,maximize=true") == \
        ngdist.optim.NAdam(decoupled_weight_decay=True, maximize=True)
    with pytest.raises(OptionError, match=r"centered='maybe' is not 1, 0, true or false"):
        ngdist.optim.from_spec("rmsprop:centered=maybe")


def test_compile_of_a_torch_module_without_an_optimizer_is_refused():
    for given in ({}, {"optimizer": None}):
        with pytest.raises(OptionError) as info:
            ngdist.compile(make_model(), torch.zeros(2, 16), strategy="local", **given)
        assert str(info.value) == (
            "torch module Sequential has no training step and no optimizer was given: pass "
            "optimizer= (e.g. optimizer=ngdist.optim.SGD(lr=0.01), a torch optimizer such as "
            "torch.optim.SGD(model.parameters(), lr=0.01), or a spec like 'adamw:lr=1e-3')")
