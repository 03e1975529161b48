"""A float64 model trains on every digit of its hyper-parameters, as torch's Python floats.

ONNX attributes are float32; the optimizer node carries each float's exact value as well
(``ngdist_exact``) and every constant of the update is computed in float64 from it, then cast
to the parameter's type. Hyper-parameters that no float32 holds (0.1234567891...) make the
difference visible: 5 steps of each optimizer match torch within 1e-12 (a float32 constant
is 1e-9 off and more).
"""
from __future__ import annotations

import contextlib

import numpy as np
import onnx_ir as ir
import pytest
from onnx import helper

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs the torch extra: "
                            "pip install 'ngdist[torch]'")
nn = torch.nn
O = torch.optim

import ngdist  # noqa: E402
from ngdist.errors import GraphError  # noqa: E402
from ngdist.ir.domain import PREVIEW_TRAINING  # noqa: E402
from ngdist.passes.optimizers import EXACT_ATTR, OptimizerLoweringPass  # noqa: E402
from ngdist.passes.optimizers.common import make_optimizer_node  # noqa: E402

STEPS = 5
ODD = 0.1234567891234  # no float32 is within 1e-9 of it


def make_model() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def data():
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((5, 6)), rng.integers(0, 3, 5)) for _ in range(STEPS)]


def groups(m: nn.Module, second: dict) -> list[dict]:
    return [{"params": m[0].parameters()}, {"params": m[2].parameters(), **second}]


CASES = {
    "sgd": lambda m: O.SGD(groups(m, {"momentum": 0.7 * ODD, "nesterov": True,
                                      "dampening": 0.0}),
                           lr=ODD, momentum=3 * ODD, dampening=ODD, weight_decay=ODD / 10),
    "adam": lambda m: O.Adam(groups(m, {"amsgrad": True}), lr=ODD / 10,
                             betas=(1 - ODD / 3, 1 - ODD / 30), eps=ODD * 1e-6,
                             weight_decay=ODD / 10),
    "adamw": lambda m: O.AdamW(groups(m, {"weight_decay": 0.0}), lr=ODD / 10,
                               betas=(1 - ODD / 3, 1 - ODD / 30), eps=ODD * 1e-6,
                               weight_decay=ODD),
    "adagrad": lambda m: O.Adagrad(m.parameters(), lr=ODD, lr_decay=ODD, eps=ODD * 1e-8,
                                   weight_decay=ODD / 10, initial_accumulator_value=ODD),
    "rmsprop": lambda m: O.RMSprop(groups(m, {"centered": True}), lr=ODD / 10,
                                   alpha=1 - ODD / 10, eps=ODD * 1e-6, weight_decay=ODD / 10,
                                   momentum=3 * ODD),
    "adadelta": lambda m: O.Adadelta(m.parameters(), lr=ODD * 5, rho=1 - ODD, eps=ODD * 1e-5,
                                     weight_decay=ODD / 10),
    "adamax": lambda m: O.Adamax(m.parameters(), lr=ODD / 10, betas=(1 - ODD / 3, 1 - ODD / 30),
                                 eps=ODD * 1e-6, weight_decay=ODD / 10),
    "nadam": lambda m: O.NAdam(groups(m, {"decoupled_weight_decay": True}), lr=ODD / 10,
                               betas=(1 - ODD / 3, 1 - ODD / 30), eps=ODD * 1e-6,
                               weight_decay=ODD / 10, momentum_decay=ODD / 100),
    "radam": lambda m: O.RAdam(m.parameters(), lr=ODD / 10, betas=(1 - ODD / 3, 1 - ODD),
                               eps=ODD * 1e-6, weight_decay=ODD / 10),
}


@contextlib.contextmanager
def float64_default():
    """torch's NAdam keeps mu_product in the default dtype (float32 unless set), 1e-10 off
    float64 after 5 steps: the float64 reference runs under torch.set_default_dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_float64_model_matches_torch_within_1e_12(name):
    ref, module = make_model(), make_model()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=CASES[name](module),
                             strategy="local")
    with float64_default():
        ref_opt = CASES[name](ref)
        for x, y in data():
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(torch.from_numpy(x)),
                                        torch.from_numpy(y)).backward()
            ref_opt.step()
    for x, y in data():
        trainer.step({"input": x, "y": y})
    trainer.to_torch()
    start = make_model()
    for (pname, mine), theirs, before in zip(module.named_parameters(), ref.parameters(),
                                             start.parameters()):
        mine, theirs, before = (t.detach().numpy() for t in (mine, theirs, before))
        assert np.abs(theirs - before).max() > 1e-3, pname  # the steps moved it
        assert np.abs(mine - theirs).max() <= 1e-12, (pname, np.abs(mine - theirs).max())


def test_the_node_carries_every_float_exactly_and_an_edited_attribute_is_refused():
    attrs = ngdist.optim.SGD(lr=ODD, momentum=ODD, dampening=0.5).attributes()
    node = make_optimizer_node("Momentum", ["r", "t", "x", "g", "v"], ["x2", "v2"], attrs,
                               name="opt")
    assert [(p.key, p.value) for p in node.metadata_props] == [
        (EXACT_ATTR, f"alpha={ODD!r};beta=0.5;norm_coefficient=0.0")]
    assert not [a.name for a in node.attribute if a.name == EXACT_ATTR]  # valid ONNX
    next(a for a in node.attribute if a.name == "alpha").f = 0.5  # edited
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, 1, [2]) for n in ("r", "x", "g", "v")]
        + [helper.make_tensor_value_info("t", 7, [])],
        [helper.make_tensor_value_info(n, 1, [2]) for n in ("x2", "v2")])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(PREVIEW_TRAINING, 1)])
    with pytest.raises(GraphError, match=r"^optimizer node 'opt': attribute 'alpha' is 0.5 but "
                                         r"ngdist_exact says 0.1234567891234; edit both, or "
                                         r"remove ngdist_exact to use the attributes"):
        OptimizerLoweringPass()(ir.serde.deserialize_model(proto))
