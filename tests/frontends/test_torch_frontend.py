"""PyTorch frontend: export with training semantics, gradients against torch autograd,
optimizer translation, a CNN trained on digits on 2 ranks, weights written back."""
from __future__ import annotations

import numpy as np
import pytest

import torch  # noqa: E402
nn = torch.nn

import ngdist  # noqa: E402
from ngdist.data import load_digits  # noqa: E402
from ngdist.errors import GraphError  # noqa: E402
from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import (dropout_mask_outputs, gradient_errors, max_rel_err, rank_results,
                        run_step, torch_step)  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


CNN_SOURCE = """
def make_cnn(torch, seed=0):
    torch.manual_seed(seed)
    nn = torch.nn
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Dropout(0.1), nn.Linear(128, 10))
"""
exec(CNN_SOURCE)  # noqa: S102  (the same definition runs inside the 2-rank script)


def make_mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


@pytest.fixture(scope="module")
def digits():
    return load_digits(images=True)


def test_export_keeps_training_semantics_and_state_dict_names():
    module = make_cnn(torch)  # noqa: F821
    before = {k: v.clone() for k, v in module.state_dict().items()}
    module.eval()
    model, exp = tfront.training_model(module, torch.zeros(2, 1, 8, 8), optimizer="sgd:lr=0.01")
    # tracing in training mode moves BN statistics: the frontend puts them back
    for k, v in module.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not module.training
    assert set(exp.params) == {n for n, _ in module.named_parameters()}
    assert set(exp.buffers) == {"1.running_mean", "1.running_var"}
    alg = model.training_info[0].algorithm
    bn = next(n for n in alg.node if n.op_type == "BatchNormalization")
    assert next(a.i for a in bn.attribute if a.name == "training_mode") == 1
    assert any(n.op_type == "Dropout" for n in alg.node)
    # the deployable graph is the eval-mode export: no dropout, running statistics
    assert not any(n.op_type == "Dropout" for n in model.graph.node)
    bn_eval = next(n for n in model.graph.node if n.op_type == "BatchNormalization")
    assert next((a.i for a in bn_eval.attribute if a.name == "training_mode"), 0) == 0
    binding = {kv.key: kv.value for kv in model.training_info[0].update_binding}
    assert {"1.running_mean", "1.running_var"} <= set(binding)


def test_first_step_loss_and_gradients_match_autograd(digits):
    xtr, ytr, _, _ = digits
    module = make_cnn(torch)  # noqa: F821
    model, exp = tfront.training_model(module, torch.zeros(2, 1, 8, 8),
                                       loss=nn.CrossEntropyLoss(), optimizer="sgd:lr=0.01")
    masks = dropout_mask_outputs(model, module)
    got = run_step(model, {"input": xtr[:32], "y": ytr[:32]}, extra=list(masks.values()))
    # reference: torch autograd in float64 on the same batch, with ngdist's dropout mask
    loss, grads, _ = torch_step(module, xtr[:32], ytr[:32], nn.CrossEntropyLoss(),
                                {p: got[name] for p, name in masks.items()}, float64=True)
    assert abs(float(got["loss"]) - loss) <= 1e-4 * abs(loss)
    assert set(grads) == set(exp.params)
    errors = gradient_errors(got, grads)  # the conv bias before BatchNorm: zero in theory
    assert max(errors.values()) <= 1e-4, errors


def test_mse_loss_gradients_match_autograd():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 64)).astype(np.float32)
    y = rng.standard_normal((16, 10)).astype(np.float32)
    module = make_mlp(seed=2)
    model, _ = tfront.training_model(module, torch.zeros(2, 64), loss=nn.MSELoss(),
                                     optimizer="sgd:lr=0.01")
    got = run_step(model, {"input": x, "y": y})
    loss, grads, _ = torch_step(module, x, y, nn.MSELoss(), float64=True)
    assert abs(float(got["loss"]) - loss) <= 1e-4 * abs(loss)
    assert max(gradient_errors(got, grads).values()) <= 1e-4


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-3),
    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, nesterov=True),
    # eps=0 keeps 0 / 0 away from weights whose regularized gradient cancels; epsilon's
    # placement is checked in test_torch_optimizers.py
    lambda ps: torch.optim.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=0.0, weight_decay=1e-3),
], ids=["sgd_momentum_wd", "sgd_nesterov", "adam_wd"])
def test_optimizer_translation_follows_torch_and_state_is_written_back(make_opt, digits):
    # dense random inputs: no parameter has an all-zero gradient (0 / 0 in Adam with eps=0)
    _, ytr, _, _ = digits
    x = np.random.default_rng(0).standard_normal((96, 64)).astype(np.float32)
    module, ref = make_mlp(), make_mlp()
    trainer = ngdist.compile(module, torch.zeros(2, 64), loss=nn.CrossEntropyLoss(),
                             optimizer=make_opt(module.parameters()), strategy="local")
    opt = make_opt(ref.parameters())
    for i in range(3):
        xb, yb = x[32 * i:32 * (i + 1)], ytr[32 * i:32 * (i + 1)]
        trainer.step({"input": xb, "y": yb})
        opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(xb)), torch.from_numpy(yb)).backward()
        opt.step()
    user_opt = make_opt(module.parameters())
    trainer.to_torch(optimizer=user_opt)
    for (name, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        assert max_rel_err(mine.detach().numpy(), theirs.detach().numpy()) <= 1e-5, name
        state, ref_state = user_opt.state[mine], opt.state[theirs]
        for key in ("momentum_buffer", "exp_avg", "exp_avg_sq"):
            if key in ref_state:
                assert max_rel_err(state[key].numpy(), ref_state[key].numpy()) <= 1e-4, key
        if "step" in ref_state:
            assert float(state["step"]) == float(ref_state["step"]) == 3.0


def test_unsupported_inputs_fail_clearly():
    mlp = make_mlp()
    groups = [{"params": mlp[0].parameters(), "lr": 0.1}, {"params": mlp[2].parameters()}]
    with pytest.raises(GraphError, match=r"has 2 param groups: pass the module too"):
        tfront.translate_optimizer(torch.optim.SGD(groups, lr=0.01))
    with pytest.raises(GraphError, match="optimizer ASGD has no ngdist counterpart"):
        tfront.translate_optimizer(torch.optim.ASGD(mlp.parameters()))
    # losses without a built-in form are exported with the model (test_torch_losses.py)
    assert tfront.translate_loss(nn.L1Loss()) is None
    assert tfront.translate_loss(nn.CrossEntropyLoss(label_smoothing=0.1)) is None
    bn = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3, momentum=None))
    with pytest.raises(GraphError, match=r"BatchNorm '1' has momentum=None"):
        tfront.export(bn, torch.zeros(2, 4))
    with pytest.raises(GraphError, match="params= and output= apply to ONNX models"):
        ngdist.compile(mlp, torch.zeros(2, 64), params=["0.weight"])


TRAIN_SCRIPT = CNN_SOURCE + """
import hashlib, json, sys
import numpy as np, onnxruntime as ort, torch
import ngdist
from ngdist.data import load_digits

torch.set_num_threads(1)


def softmax(z):  # predictions as class probabilities: logits' rounding scales with them
    e = np.exp(z - z.max(1, keepdims=True))
    return e / e.sum(1, keepdims=True)


xtr, ytr, xte, yte = load_digits(images=True)
module = make_cnn(torch)
opt = torch.optim.SGD(module.parameters(), lr=0.05, momentum=0.9)
trainer = ngdist.compile(module, torch.zeros(2, 1, 8, 8), loss=torch.nn.CrossEntropyLoss(),
                         optimizer=opt, timeout=60)
rng = np.random.default_rng(0)
for epoch in range(12):
    order = rng.permutation(len(xtr))
    for i in range(0, len(order) - 63, 64):
        idx = order[i:i + 64]
        trainer.step(next(trainer.shard([{"input": xtr[idx], "y": ytr[idx]}])))
params = trainer.parameters()
path = sys.argv[1]
trainer.save(path)
trainer.to_torch()
module.eval()
digest = {k: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
          for k, v in sorted(params.items())}  # the bytes of every parameter
if trainer.rank == 0:
    saved = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(
        None, {"input": xte})[0]
    with torch.no_grad():
        mine = module(torch.from_numpy(xte)).numpy()
    print("RESULT " + json.dumps({"acc": float((saved.argmax(1) == yte).mean()),
                                  "diff": float(np.abs(softmax(mine) - softmax(saved)).max()),
                                  "logit_diff": float(np.abs(mine - saved).max()),
                                  "same_classes": bool((mine.argmax(1) == saved.argmax(1)).all()),
                                  "digest": digest}))
else:
    print("RESULT " + json.dumps({"digest": digest}))
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_torch_cnn_on_two_ranks_reaches_097_and_writes_back(ranks, tmp_path):
    proc = ranks(2, TRAIN_SCRIPT, timeout=240, args=[str(tmp_path / "torch_cnn.onnx")])
    main, results = rank_results(proc, 2)
    assert main["acc"] >= 0.97, main
    assert main["diff"] <= 1e-5 and main["same_classes"], main
    assert results[0]["digest"] == results[1]["digest"]  # the same bytes on both ranks
