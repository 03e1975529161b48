"""Every torch.optim optimizer ngdist translates, step by step against torch itself.

The module is float64, so torch is the float64 reference and ngdist trains the same float64
graph: after 8 steps (RAdam's rectification starts at step 6 with beta2 = 0.9) every
parameter is within 1e-5 of torch's (measured: 2e-8 at most, the learning rate being a
float32 value of the step). Each optimizer runs with weight decay, with ``maximize`` and with
two parameter groups that differ in every hyper-parameter they can.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs the torch extra: "
                            "pip install 'ngdist[torch]'")
nn = torch.nn
O = torch.optim

import ngdist  # noqa: E402
from ngdist.errors import NgdistError, OptionError  # noqa: E402
from ngdist.frontends import torch as tfront  # noqa: E402
from step_probe import max_rel_err  # noqa: E402

STEPS = 8


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3)).double()


def data(steps: int = STEPS):
    rng = np.random.default_rng(0)
    return [(rng.standard_normal((5, 6)), rng.integers(0, 3, 5)) for _ in range(steps)]


def two_groups(m: nn.Module, first: dict, second: dict) -> list[dict]:
    return [{"params": [*m[0].parameters(), *m[1].parameters()], **first},
            {"params": m[3].parameters(), **second}]


def train_torch(make_opt):
    ref = make_model()
    opt = make_opt(ref)
    for x, y in data():
        opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        opt.step()
    return ref, opt


def train_ngdist(make_opt, strategy: str = "local"):
    module = make_model()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=make_opt(module),
                             strategy=strategy)
    for x, y in data():
        trainer.step({"input": x, "y": y})
    trainer.to_torch()
    return module, trainer


CASES = {
    "sgd_nesterov_wd_max": lambda m: O.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=True,
                                           weight_decay=0.01, maximize=True),
    "adam_wd_max": lambda m: O.Adam(m.parameters(), lr=0.01, weight_decay=0.01, maximize=True),
    "adamw_amsgrad_max": lambda m: O.AdamW(m.parameters(), lr=0.01, betas=(0.9, 0.5),
                                           amsgrad=True, maximize=True),
    "adagrad": lambda m: O.Adagrad(m.parameters(), lr=0.1, lr_decay=0.1, weight_decay=0.01,
                                   initial_accumulator_value=0.5, eps=1e-6),
    "adagrad_max": lambda m: O.Adagrad(m.parameters(), lr=0.1, maximize=True),
    "rmsprop": lambda m: O.RMSprop(m.parameters(), lr=0.01, weight_decay=0.01),
    "rmsprop_centered_momentum_max": lambda m: O.RMSprop(
        m.parameters(), lr=0.01, alpha=0.9, eps=1e-6, centered=True, momentum=0.9,
        weight_decay=0.01, maximize=True),
    "adadelta": lambda m: O.Adadelta(m.parameters(), lr=1.0, rho=0.8, weight_decay=0.01),
    "adadelta_max": lambda m: O.Adadelta(m.parameters(), maximize=True),
    "adamax": lambda m: O.Adamax(m.parameters(), betas=(0.8, 0.9), weight_decay=0.01),
    "adamax_max": lambda m: O.Adamax(m.parameters(), maximize=True),
    "nadam": lambda m: O.NAdam(m.parameters(), weight_decay=0.01, momentum_decay=0.01),
    "nadam_decoupled_max": lambda m: O.NAdam(m.parameters(), weight_decay=0.01,
                                             decoupled_weight_decay=True, maximize=True),
    "radam": lambda m: O.RAdam(m.parameters(), betas=(0.9, 0.9), weight_decay=0.01),
    "radam_decoupled_max": lambda m: O.RAdam(m.parameters(), betas=(0.9, 0.9), weight_decay=0.1,
                                             decoupled_weight_decay=True, maximize=True),
    # two groups, every hyper-parameter that may differ differs
    "sgd_groups": lambda m: O.SGD(two_groups(m, {"lr": 0.2, "momentum": 0.5},
                                             {"dampening": 0.3, "weight_decay": 0.1}),
                                  lr=0.1, momentum=0.9),
    "adamw_groups": lambda m: O.AdamW(two_groups(m, {"weight_decay": 0.0, "betas": (0.8, 0.9)},
                                                 {"lr": 0.02, "amsgrad": True}), lr=0.01),
    "adagrad_groups": lambda m: O.Adagrad(two_groups(m, {"lr_decay": 0.5},
                                                     {"initial_accumulator_value": 0.2}),
                                          lr=0.1),
    "rmsprop_groups": lambda m: O.RMSprop(two_groups(m, {"centered": True, "momentum": 0.5},
                                                     {"alpha": 0.9, "weight_decay": 0.1}),
                                          lr=0.01),
    "adadelta_groups": lambda m: O.Adadelta(two_groups(m, {"rho": 0.5}, {"lr": 0.5})),
    "adamax_groups": lambda m: O.Adamax(two_groups(m, {"eps": 1e-3}, {"betas": (0.5, 0.5)})),
    "nadam_groups": lambda m: O.NAdam(two_groups(m, {"momentum_decay": 0.1},
                                                 {"weight_decay": 0.1,
                                                  "decoupled_weight_decay": True})),
    "radam_groups": lambda m: O.RAdam(two_groups(m, {"betas": (0.9, 0.9)},
                                                 {"weight_decay": 0.1})),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_optimizer_follows_torch_step_by_step(name):
    ref, ref_opt = train_torch(CASES[name])
    module, trainer = train_ngdist(CASES[name])
    start = make_model()
    for (pname, mine), theirs, before in zip(module.named_parameters(), ref.parameters(),
                                             start.parameters()):
        mine, theirs, before = (t.detach().numpy() for t in (mine, theirs, before))
        assert not np.array_equal(theirs, before), pname  # the step moved it
        assert np.abs(mine - theirs).max() <= 1e-5, pname
        assert max_rel_err(mine - before, theirs - before) <= 1e-5, pname
    if name.endswith("_groups"):
        assert len(trainer.lr) == 2
    # the state written back into a torch optimizer is torch's, and torch goes on from it
    user_opt = CASES[name](module)
    trainer.to_torch(optimizer=user_opt)
    assert_same_state(user_opt, module, ref_opt, ref, 1e-5)
    x, y = data()[0]
    for m, o in ((module, user_opt), (ref, ref_opt)):
        o.zero_grad()
        nn.functional.cross_entropy(m(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        o.step()
    for (pname, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        assert np.abs(mine.detach().numpy() - theirs.detach().numpy()).max() <= 1e-5, pname


def assert_same_state(opt, module: nn.Module, ref_opt, ref: nn.Module, tol: float) -> None:
    """``opt``'s state of each parameter of ``module`` is ``ref_opt``'s of ``ref``'s, key for
    key, within ``tol``."""
    for mine, theirs in zip(module.parameters(), ref.parameters()):
        state, want = opt.state[mine], ref_opt.state[theirs]
        assert set(state) == set(want)
        for key in want:
            assert np.abs(np.asarray(state[key]) - np.asarray(want[key])).max() <= tol, key


def test_two_groups_are_two_optimizer_nodes_with_their_own_constants():
    module = make_model()
    opt = O.AdamW(two_groups(module, {"weight_decay": 0.0}, {}), lr=0.01, weight_decay=0.05)
    got = tfront.translate_optimizer(opt, module)
    assert got == ngdist.optim.AdamW(lr=0.01, weight_decay=0.0, groups=(  # group 0 first
        {"params": ["0.weight", "0.bias", "1.weight", "1.bias"], "lr": 0.01,
         "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0, "amsgrad": False,
         "maximize": False},
        {"params": ["3.weight", "3.bias"], "lr": 0.01, "betas": (0.9, 0.999), "eps": 1e-8,
         "weight_decay": 0.05, "amsgrad": False, "maximize": False}))
    proto, _ = tfront.build(module, torch.zeros(2, 6, dtype=torch.float64),
                            loss=nn.CrossEntropyLoss(), optimizer=opt)
    nodes = [n for n in proto.training_info[0].algorithm.node if n.op_type == "Adam"]
    assert [n.name for n in nodes] == ["ngdist/adam", "ngdist/adam.1"]
    decay = [[a.f for a in n.attribute if a.name == "norm_coefficient"] for n in nodes]
    assert decay == [[0.0], [np.float32(0.05)]]
    assert [n.input[0] for n in nodes] == ["ngdist.lr", "ngdist.lr.1"]


def test_the_translation_names_every_hyper_parameter():
    ps = list(make_model().parameters())
    assert tfront.translate_optimizer(O.RMSprop(ps, lr=0.1, alpha=0.5, eps=1e-3, momentum=0.2,
                                                centered=True, maximize=True)) == \
        ngdist.optim.RMSprop(lr=0.1, alpha=0.5, eps=1e-3, momentum=0.2, centered=True,
                             maximize=True)
    assert tfront.translate_optimizer(O.Adadelta(ps)) == ngdist.optim.Adadelta()
    assert tfront.translate_optimizer(O.Adagrad(ps, initial_accumulator_value=0.1)) == \
        ngdist.optim.Adagrad(initial_accumulator_value=0.1)
    assert tfront.translate_optimizer(O.NAdam(ps, decoupled_weight_decay=True)) == \
        ngdist.optim.NAdam(decoupled_weight_decay=True)
    assert tfront.translate_optimizer(O.RAdam(ps)) == ngdist.optim.RAdam()
    assert tfront.translate_optimizer(O.Adamax(ps)) == ngdist.optim.Adamax()
    assert tfront.translate_optimizer(O.Adam(ps, decoupled_weight_decay=True,
                                             weight_decay=0.1)) == \
        ngdist.optim.AdamW(weight_decay=0.1)


# --------------------------------------------------------------------------- mistakes

@pytest.mark.parametrize("make, message", [
    (lambda: ngdist.optim.SGD(lr="0.05"),
     r"^SGD\(lr='0.05'\): lr takes a number, not a str$"),
    (lambda: ngdist.optim.AdamW(betas=0.9),
     r"^AdamW\(betas=0.9\): betas takes two numbers \(BETA1, BETA2\), not a float$"),
    (lambda: ngdist.optim.RMSprop(centered="yes"),
     r"^RMSprop\(centered='yes'\): centered takes True or False, not a str$"),
    (lambda: ngdist.optim.Adagrad(lr=True), r"lr takes a number, not a bool"),
    (lambda: ngdist.optim.SGD(lr=-0.1), r"^SGD\(lr=-0.1\): lr must be in \[0.0, inf\)$"),
    (lambda: ngdist.optim.NAdam(betas=(0.9, 1.0)), r"betas must be in \[0.0, 1.0\)"),
    (lambda: ngdist.optim.Adam(groups={"params": ["w"]}), r"takes a list of dicts"),
    (lambda: ngdist.optim.Adam(groups=[{"lr": 0.1}]), r"group 0 needs 'params'"),
    (lambda: ngdist.optim.AdamW(groups=[{"params": ["w"], "weight_decy": 0.0}]),
     r"unknown key 'weight_decy' for AdamW group 0; did you mean 'weight_decay'"),
    (lambda: ngdist.optim.SGD(groups=[{"params": ["w"], "lr": "1"}]),
     r"SGD\(lr='1'\): lr takes a number, not a str"),
    (lambda: ngdist.optim.RMSprop(scheduled_momentum=True),
     r"^RMSprop\(scheduled_momentum=True\): a scheduled momentum \(beta1\) starts above 0"),
    (lambda: ngdist.optim.KerasAdamax(scheduled_momentum=True),
     r"^KerasAdamax\(scheduled_momentum=True\): KerasAdamax has no momentum that ngdist "
     r"follows from a scheduler"),
])
def test_a_wrong_hyper_parameter_is_an_option_error_naming_it(make, message):
    with pytest.raises(OptionError, match=message):
        make()
    assert issubclass(OptionError, NgdistError)


def test_groups_that_name_unknown_or_shared_parameters_are_refused():
    opt = ngdist.optim.SGD(groups=[{"params": ["w", "b"]}, {"params": ["b"]}])
    with pytest.raises(OptionError, match=r"parameter 'b' is in groups 0 and 1"):
        opt.param_groups(["w", "b"])
    with pytest.raises(OptionError, match=r"group 1 names 'b', which is not a trained "
                                          r"parameter; the trained parameters are \['w'\]"):
        ngdist.optim.SGD(groups=[{"params": ["w"]}, {"params": ["b"]}]).param_groups(["w"])
    torch_opt = O.SGD(make_model().parameters(), lr=0.1)
    torch_opt.param_groups[0]["lr"] = "0.1"
    with pytest.raises(OptionError, match=r"^torch.optim.SGD: SGD\(lr='0.1'\): lr takes a "):
        tfront.translate_optimizer(torch_opt)


def test_ngdist_groups_on_a_torch_module_name_its_parameters():
    module = make_model()
    with pytest.raises(OptionError, match=r"AdamW group 0 names '3.wieght', which is not a "
                                          r"trained parameter"):
        ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                       loss=nn.CrossEntropyLoss(), strategy="local",
                       optimizer=ngdist.optim.AdamW(groups=[{"params": ["3.wieght"]}]))
    # torch's groups may hold a frozen parameter: it is not trained, and not an error
    opt = O.AdamW(two_groups(module, {}, {"weight_decay": 0.0}), lr=0.01)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), strategy="local", optimizer=opt,
                             frozen=["3.bias"])
    assert sorted(trainer.meta.names("param")) == ["0.bias", "0.weight", "1.bias", "1.weight",
                                                   "3.weight"]


def test_a_float64_model_learns_at_every_digit_of_its_learning_rate():
    """torch keeps lr a Python float: a float64 model's update is float64 through and through,
    also after a scheduler changes it (a float32 lr was 1e-9 off after 5 AdamW steps; the
    other hyper-parameters: test_torch_optim_float64.py)."""
    def make_opt(m):
        return O.AdamW(two_groups(m, {"weight_decay": 0.0}, {"lr": 0.003}), lr=0.01,
                       betas=(0.5, 0.75), eps=2 ** -10, weight_decay=0.25)

    ref, module = make_model(), make_model()
    ref_opt, opt = make_opt(ref), make_opt(module)
    ref_sched = O.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.7)
    sched = O.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local")
    inits = trainer.step_model.graph.initializers
    assert [inits[n].const_value.numpy().dtype for n in ("ngdist.lr", "ngdist.lr.1")] == \
        [np.float64, np.float64]
    for x, y in data(5):
        step_both(ref, ref_opt, ref_sched, trainer, sched, x, y)
    # torch's Python floats exactly (the schedule made them 0.7 * 0.7 * lr, 5 steps in)
    assert trainer.lr == {i: g["lr"] for i, g in enumerate(ref_opt.param_groups)}
    assert trainer.lr[1] != float(np.float32(trainer.lr[1]))
    trainer.to_torch()
    for (pname, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        assert np.abs(mine.detach().numpy() - theirs.detach().numpy()).max() <= 1e-12, pname


def step_both(ref: nn.Module, ref_opt, ref_sched, trainer, sched, x, y) -> None:
    """One step of torch (then its scheduler) and of the trainer (then its own scheduler)."""
    ref_opt.zero_grad()
    nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
    ref_opt.step()
    ref_sched.step()
    trainer.step({"input": x, "y": y})
    sched.step()
