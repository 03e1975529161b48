"""ngdist.optim on ONNX files: parameter groups against torch (float64), ``maximize`` on ONNX's
own optimizer ops against the ONNX reference evaluator, the formulas surviving save and load,
``ngdist inspect`` showing the groups, and malformed optimizer nodes refused."""
from __future__ import annotations

import dataclasses

import argparse

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import ngdist
from ngdist import zoo
from ngdist.errors import GraphError
from ngdist.ir.domain import PREVIEW_TRAINING
from step_probe import run_step

torch = pytest.importorskip("torch", reason="the torch oracle needs the torch extra: "
                            "pip install 'ngdist[torch]'")


def forward() -> onnx.ModelProto:
    return zoo.mlp((6, 10, 3), dtype=np.float64)


def batches(n: int = 5):
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((8, 6)), rng.standard_normal((8, 3))) for _ in range(n)]


def init_values() -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in forward().graph.initializer}


def torch_reference(make_opt, steps: int = 5, lrs: list | None = None
                    ) -> dict[str, np.ndarray]:
    """The same MLP (Gemm transB=1, Relu) trained by torch on mean((out - y)^2) in float64;
    ``make_opt`` gives the optimizer, or (optimizer, scheduler) whose lrs go to ``lrs``."""
    p = {k: torch.tensor(v, requires_grad=True) for k, v in init_values().items()}
    made = make_opt(p)
    opt, sched = made if isinstance(made, tuple) else (made, None)
    for x, y in batches(steps):
        if lrs is not None:
            lrs.append([g["lr"] for g in opt.param_groups])
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        h = torch.relu(x @ p["fc0.weight"].T + p["fc0.bias"])
        out = h @ p["fc1.weight"].T + p["fc1.bias"]
        opt.zero_grad()
        ((out - y) ** 2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
    return {k: v.detach().numpy() for k, v in p.items()}


def train(opt, steps: int = 5) -> ngdist.Trainer:
    trainer = ngdist.compile(forward(), loss="mse", optimizer=opt, strategy="local")
    for x, y in batches(steps):
        trainer.step({"x": x, "y": y})
    return trainer


def test_adamw_groups_without_decay_on_biases_follow_torch():
    biases = ["fc0.bias", "fc1.bias"]
    opt = ngdist.optim.AdamW(lr=0.01, weight_decay=0.01,
                             groups=[{"params": biases, "weight_decay": 0.0, "lr": 0.02}])
    want = torch_reference(lambda p: torch.optim.AdamW(
        [{"params": [p[b] for b in biases], "weight_decay": 0.0, "lr": 0.02},
         {"params": [p["fc0.weight"], p["fc1.weight"]]}], lr=0.01, weight_decay=0.01))
    got = train(opt).state_dict()
    for k, v in want.items():
        assert np.abs(got[k] - v).max() <= 1e-5, k
    # without the groups the biases decay, and the result is measurably another one
    plain = train(ngdist.optim.AdamW(lr=0.01, weight_decay=0.01)).state_dict()
    assert np.abs(plain["fc0.bias"] - want["fc0.bias"]).max() > 1e-4


@pytest.mark.parametrize("opt, op", [
    (ngdist.optim.SGD(lr=0.1, momentum=0.9, weight_decay=0.01, maximize=True), "Momentum"),
    (ngdist.optim.Adam(lr=0.1, weight_decay=0.01, maximize=True), "Adam"),
    (ngdist.optim.Adagrad(lr=0.1, lr_decay=0.1, weight_decay=0.01, maximize=True), "Adagrad"),
])
def test_maximize_on_an_onnx_op_is_the_reference_op_on_the_negated_gradient(opt, op):
    model = ngdist.to_training_model(forward(), loss="mse", optimizer=opt)
    x, y = batches(1)[0]
    grads = run_step(model, {"x": x, "y": y})
    node = next(n for n in model.training_info[0].algorithm.node if n.op_type == op)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute
             if not a.name.startswith("ngdist_")}
    names = list(init_values())
    states = [f"S{i}" for i in range(len(opt.state_suffixes))]
    ins = ["R", "T", "X", "G", *states]
    ref = ReferenceEvaluator(helper.make_model(helper.make_graph(
        [helper.make_node(op, ins, ["X.new", *[f"{s}.new" for s in states]],
                          domain=PREVIEW_TRAINING, **attrs)], "ref",
        [helper.make_tensor_value_info(n, onnx.TensorProto.UNDEFINED, None) for n in ins],
        [helper.make_tensor_value_info("X.new", onnx.TensorProto.UNDEFINED, None)]),
        opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(PREVIEW_TRAINING, 1)]))
    trainer = ngdist.compile(model, strategy="local")
    trainer.step({"x": x, "y": y})
    got = trainer.state_dict()
    for name in names:
        x0 = init_values()[name]
        (want,) = ref.run(None, {"R": np.array(0.1), "T": np.array(opt.step_offset),
                                 "X": x0, "G": -grads[f"{name}.grad"],
                                 **{s: np.zeros_like(x0) for s in states}})
        assert np.abs(got[name] - want).max() <= 1e-6, name
        assert np.abs(got[name] - x0).max() > 1e-3, name


@pytest.mark.parametrize("opt", [
    ngdist.optim.RMSprop(lr=0.01, centered=True, momentum=0.5,
                         groups=[{"params": ["fc1.bias"], "alpha": 0.5}]),
    # a scheduled beta1: its value, NAdam's mu_product and the exact floats are in the file
    ngdist.optim.NAdam(lr=0.01, betas=(0.1234567891234, 0.75), scheduled_momentum=True,
                       groups=[{"params": ["fc1.bias"], "lr": 0.02}]),
], ids=["rmsprop", "nadam_scheduled"])
def test_a_formula_and_its_groups_survive_save_and_load(tmp_path, opt):
    straight = train(opt, 3).state_dict()
    trainer = train(opt, 2)
    trainer.save(tmp_path / "opt.onnx")
    resumed = ngdist.compile(tmp_path / "opt.onnx", strategy="local")
    x, y = batches(3)[2]
    resumed.step({"x": x, "y": y})
    assert set(resumed.state_dict()) == set(straight)
    for k, v in straight.items():
        np.testing.assert_array_equal(resumed.state_dict()[k], v, err_msg=k)


def test_inspect_shows_the_groups(tmp_path, capsys):
    from ngdist.cli import inspect

    opt = ngdist.optim.AdamW(lr=0.01, groups=[{"params": ["fc0.bias", "fc1.bias"],
                                               "weight_decay": 0.0}])
    path = tmp_path / "adamw.onnx"
    onnx.save(ngdist.to_training_model(forward(), loss="mse", optimizer=opt), path)
    inspect.run(argparse.Namespace(file=str(path), explain=False, dot=None, shard=None,
                                   shard_ranks=None))
    out = capsys.readouterr().out.splitlines()
    at = out.index("optimizer: 2 group(s)")
    assert out[at + 1:at + 5] == [
        "  group 0  ngdist/adam  torch_adamw  lr=ngdist.lr (0.01)  alpha=0.9 beta=0.999 "
        "epsilon=1e-08 norm_coefficient=0.0 norm_coefficient_post=0.0",
        "      params: fc0.bias, fc1.bias",
        "  group 1  ngdist/adam.1  torch_adamw  lr=ngdist.lr.1 (0.01)  alpha=0.9 beta=0.999 "
        "epsilon=1e-08 norm_coefficient=0.01 norm_coefficient_post=0.0",
        "      params: fc0.weight, fc1.weight"]


def test_a_formula_on_the_wrong_op_is_refused():
    model = ngdist.to_training_model(forward(), loss="mse", optimizer=ngdist.optim.SGD())
    node = next(n for n in model.training_info[0].algorithm.node if n.op_type == "Momentum")
    node.attribute.append(helper.make_attribute("ngdist_formula", "rmsprop"))
    with pytest.raises(GraphError, match=r"ngdist_formula='rmsprop' is a formula of Adagrad "
                                         r"nodes \(ngdist.optim writes it there\), not of "
                                         r"Momentum$"):
        ngdist.compile(model, strategy="local")
    node.attribute[-1].s = b"lamb"
    with pytest.raises(GraphError, match=r"ngdist_formula='lamb' is not a formula ngdist knows; "
                                         r"the formulas are \['adadelta', 'adamax'"):
        ngdist.compile(model, strategy="local")


# --------------------------------------------------------------------------- schedules

def test_a_warmup_schedule_on_an_onnx_file_follows_hugging_face():
    transformers = pytest.importorskip("transformers", reason="the oracle is Hugging Face's "
                                       "get_linear_schedule_with_warmup")
    from ngdist.optim import schedules

    biases = ["fc0.bias", "fc1.bias"]
    opt = ngdist.optim.AdamW(lr=0.05, groups=[{"params": biases, "weight_decay": 0.0}])
    lrs_torch = []

    def make_opt(p):
        o = torch.optim.AdamW([{"params": [p[b] for b in biases], "weight_decay": 0.0},
                               {"params": [p["fc0.weight"], p["fc1.weight"]]}], lr=0.05)
        return o, transformers.get_linear_schedule_with_warmup(o, 2, 6)

    want = torch_reference(make_opt, steps=5, lrs=lrs_torch)
    trainer = ngdist.compile(forward(), loss="mse", optimizer=opt, strategy="local")
    trainer.set_lr_schedule(schedules.warmup_linear(2, 6))
    lrs = []
    for x, y in batches(5):
        trainer.step({"x": x, "y": y})
        lrs.append(list(trainer.lr.values()))
    np.testing.assert_allclose(lrs, lrs_torch, rtol=1e-7)
    assert lrs[0] == [0.0, 0.0] and lrs[2][0] == pytest.approx(0.05)
    for k, v in want.items():
        assert np.abs(trainer.state_dict()[k] - v).max() <= 1e-6, k


def test_schedules_are_hugging_faces_and_torchs_factors():
    transformers = pytest.importorskip("transformers", reason="Hugging Face's schedules")
    from ngdist.optim import schedules

    p = torch.nn.Parameter(torch.zeros(1))
    for ours, theirs in [
            (schedules.warmup_cosine(3, 11),
             transformers.get_cosine_schedule_with_warmup(torch.optim.SGD([p], lr=1.0), 3, 11)),
            (schedules.step_decay(4, 0.5),
             torch.optim.lr_scheduler.StepLR(torch.optim.SGD([p], lr=1.0), 4, 0.5))]:
        factors = []
        for _ in range(14):
            factors.append(theirs.get_last_lr()[0])
            theirs.optimizer.step()
            theirs.step()
        assert [ours(s) for s in range(14)] == pytest.approx(factors, rel=1e-12)
    assert schedules.from_spec("warmup_cosine:warmup=10", total=100) == \
        schedules.warmup_cosine(10, 100)
    with pytest.raises(ngdist.errors.OptionError, match=r"lr schedule 'warmup_linear:warmup=5' "
                                                        r"needs \['total'\]"):
        schedules.from_spec("warmup_linear:warmup=5")
    with pytest.raises(ngdist.errors.OptionError,
                       match=r"unknown lr schedule 'cosine' in 'cosine'; "
                             r"choose one of \['step_decay', "):
        schedules.from_spec("cosine")
    with pytest.raises(ngdist.errors.OptionError, match=r"warmup_linear\(warmup=1.5\): warmup "
                                                        r"takes a whole number of steps"):
        schedules.warmup_linear(1.5, 10)


PS_SCRIPT = """
import sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

X, Y, _, _ = load_digits()
opt = {opt}
result = {{}}
for strategy, extra in (("allreduce", {{}}), ("ps", {{"grad_shard_bytes": 2048}})):
    tr = ngdist.compile(zoo.mlp((64, 16, 10)), optimizer=opt, strategy=strategy, timeout=60,
                        **extra)
    for i in range(3):
        for xb, yb in tr.shard([(X[16 * i:16 * (i + 1)], Y[16 * i:16 * (i + 1)])]):
            tr.step({{"x": xb, "y": yb}})
    tr.sync_state() if strategy == "ps" else None
    result[strategy] = {{k: v for k, v in tr.state_dict().items() if "." in k and
                         k.split(".")[0].startswith("fc") and k.count(".") == 1}}
    tr.close()
if tr.rank == 0:
    np.savez("allreduce.npz", **result["allreduce"])
    np.savez("ps.npz", **result["ps"])
"""


@pytest.mark.mpi
@pytest.mark.parametrize("opt", [
    "ngdist.optim.NAdam(lr=0.01, weight_decay=0.01, decoupled_weight_decay=True)",
    "ngdist.optim.RMSprop(lr=0.01, centered=True, momentum=0.5, maximize=False)",
    "ngdist.optim.Adagrad(lr=0.1, initial_accumulator_value=0.5, lr_decay=0.1)",
    "ngdist.optim.RAdam(lr=0.01, betas=(0.9, 0.9))",
])
def test_the_ps_strategy_applies_every_formula_on_its_shards(ranks, tmp_path, opt):
    ranks(2, PS_SCRIPT.format(opt=opt), timeout=150)
    want, got = np.load(tmp_path / "allreduce.npz"), np.load(tmp_path / "ps.npz")
    assert sorted(want) == ["fc0.bias", "fc0.weight", "fc1.bias", "fc1.weight"]
    for k in want:
        assert np.abs(got[k] - want[k]).max() <= 1e-6, k
        assert np.abs(got[k] - init_digits_mlp()[k]).max() > 1e-4, k


def init_digits_mlp() -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in zoo.mlp((64, 16, 10)).graph.initializer}


def test_a_schedule_resumed_from_a_checkpoint_scales_the_compiled_rates(tmp_path):
    from ngdist.optim import schedules

    def run(steps: range, folder) -> ngdist.Trainer:
        tr = ngdist.compile(forward(), loss="mse", optimizer=ngdist.optim.SGD(lr=0.1),
                            strategy="local", checkpoint_every=2, checkpoint_dir=folder)
        tr.set_lr_schedule(schedules.step_decay(1, 0.5))
        data = batches(4)
        for i in steps[tr.resumed_from:]:
            tr.step({"x": data[i][0], "y": data[i][1]})
        return tr

    straight = run(range(4), tmp_path / "a")
    assert straight.lr == {0: pytest.approx(0.1 * 0.5 ** 3)}
    run(range(2), tmp_path / "b")
    resumed = run(range(4), tmp_path / "b")  # starts from the checkpoint of step 2
    assert resumed.resumed_from == 2
    assert resumed.lr == straight.lr
    for k, v in straight.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[k], v, err_msg=k)


def test_a_scheduled_momentum_is_an_input_of_the_step_and_refused_under_ps():
    """``scheduled_momentum``: the momentum (beta1) is a step value, and a new value trains as
    an optimizer compiled with it does (to float64 rounding); ps rebuilds the optimizer node
    without it, and says so."""
    o = ngdist.optim
    for make, key in ((lambda m: o.SGD(lr=0.1, momentum=m), "momentum"),
                      (lambda m: o.AdamW(lr=0.01, betas=(m, 0.75)), "betas"),
                      (lambda m: o.RMSprop(lr=0.01, momentum=m, centered=True), "momentum"),
                      (lambda m: o.Adamax(lr=0.01, betas=(m, 0.75)), "betas"),
                      (lambda m: o.NAdam(lr=0.01, betas=(m, 0.75)), "betas"),
                      (lambda m: o.RAdam(lr=0.01, betas=(m, 0.75)), "betas")):
        opt = dataclasses.replace(make(0.9), scheduled_momentum=True)
        scheduled, fixed = (ngdist.compile(forward(), loss="mse", optimizer=x, strategy="local")
                            for x in (opt, make(0.5)))
        assert float(scheduled.values["ngdist.momentum"].numpy()) == 0.9
        scheduled.values["ngdist.momentum"] = scheduled.placement.value(np.array(0.5))
        for x, y in batches(3):
            for tr in (scheduled, fixed):
                tr.step({"x": x, "y": y})
        got, want = scheduled.state_dict(), fixed.state_dict()
        assert max(np.abs(got[k] - want[k]).max() for k in want) <= 1e-12, key
        with pytest.raises(GraphError, match=r"reads \['[a-z_]+'.*\] from its last inputs but "
                                             r"has \d+ inputs.*not under ps or shard= \(there: "
                                             r"OneCycleLR\(\.\.\., cycle_momentum=False\)\)$"):
            ngdist.compile(forward(), loss="mse", optimizer=opt, strategy="ps")
