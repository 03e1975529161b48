"""torch.optim.lr_scheduler is followed: the trainer reads every param group's learning rate
from the torch optimizer at each step, so the user's loop (``trainer.step``; ``sched.step()``)
trains as torch's (``opt.step()``; ``sched.step()``) does. float64 module, 10 steps, every
parameter within 1e-6 of torch and the learning rates equal at every step."""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the PyTorch frontend needs the torch extra: "
                            "pip install 'ngdist[torch]'")
nn = torch.nn
O = torch.optim
S = torch.optim.lr_scheduler

import ngdist  # noqa: E402
from ngdist.errors import OptionError  # noqa: E402
from test_torch_optim_float64 import float64_default  # noqa: E402
from test_torch_optim_formulas import (assert_same_state, data as formula_data,  # noqa: E402
                                        make_model, step_both)

STEPS = 10


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def data():
    return formula_data(STEPS)


def groups(m: nn.Module) -> list[dict]:
    decay = [p for n, p in m.named_parameters() if n.endswith("weight") and not n.startswith("1.")]
    rest = [p for n, p in m.named_parameters() if not (n.endswith("weight") and
                                                      not n.startswith("1."))]
    return [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}]


def warmup(step: int) -> float:
    return min(1.0, (step + 1) / 4) * max(0.0, (STEPS - step) / STEPS)


CASES = {
    "step_lr": (lambda m: O.SGD(m.parameters(), lr=0.1, momentum=0.9),
                lambda o: S.StepLR(o, step_size=3, gamma=0.5)),
    # the Hugging Face recipe: AdamW, no decay on biases and LayerNorm, linear warm-up/decay
    "lambda_warmup_adamw_groups": (lambda m: O.AdamW(groups(m), lr=0.01),
                                   lambda o: S.LambdaLR(o, [warmup, lambda s: 0.5 ** s])),
    "one_cycle": (lambda m: O.Adam(m.parameters(), lr=0.01),
                  lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS,
                                         cycle_momentum=False)),
    "sequential_warm_restarts": (
        lambda m: O.RMSprop(m.parameters(), lr=0.01),
        lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=0.1, total_iters=3),
                                     S.CosineAnnealingWarmRestarts(o, T_0=3)], milestones=[3])),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_torch_scheduler_is_followed(name):
    make_opt, make_sched = CASES[name]
    ref = make_model()
    ref_opt = make_opt(ref)
    ref_sched = make_sched(ref_opt)
    ref_lrs = []
    for x, y in data():
        ref_lrs.append([g["lr"] for g in ref_opt.param_groups])
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        ref_opt.step()
        ref_sched.step()
    assert len({tuple(lr) for lr in ref_lrs}) > 2  # the schedule moves

    module = make_model()
    opt = make_opt(module)
    sched = make_sched(opt)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local")
    lrs = []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()"
        for x, y in data():
            trainer.step({"input": x, "y": y})
            lrs.append(list(trainer.lr.values()))  # what this step ran with
            sched.step()
    np.testing.assert_allclose(lrs, ref_lrs, rtol=1e-7)  # the step ran at torch's rate
    trainer.to_torch()
    for (pname, mine), theirs in zip(module.named_parameters(), ref.parameters()):
        assert np.abs(mine.detach().numpy() - theirs.detach().numpy()).max() <= 1e-6, pname


CYCLED = {  # OneCycleLR's and CyclicLR's default cycle_momentum=True, two groups each
    "one_cycle_sgd_momentum": (
        lambda m: O.SGD(groups(m), lr=0.1, momentum=0.9, nesterov=True),
        lambda o: S.OneCycleLR(o, max_lr=[0.5, 0.2], total_steps=STEPS)),
    "one_cycle_adamw": (lambda m: O.AdamW(groups(m), lr=0.01, betas=(0.9, 0.99)),
                        lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS,
                                               base_momentum=0.6, max_momentum=0.95)),
    "cyclic_sgd": (lambda m: O.SGD(groups(m), lr=0.1, momentum=0.9, dampening=0.1),
                   lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.1, step_size_up=3,
                                        base_momentum=0.5, max_momentum=0.9)),
    # down to momentum 0 and back: torch leaves the buffer alone on that step
    "one_cycle_sgd_dampening_to_zero": (
        lambda m: O.SGD(groups(m), lr=0.1, momentum=0.9, dampening=0.3),
        lambda o: S.OneCycleLR(o, max_lr=0.5, total_steps=STEPS, base_momentum=0.0)),
    "one_cycle_rmsprop_centered": (
        lambda m: O.RMSprop(groups(m), lr=0.01, momentum=0.9, centered=True),
        lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS, base_momentum=0.0,
                               max_momentum=0.9)),
    "cyclic_adamax": (lambda m: O.Adamax(groups(m), lr=0.01),
                      lambda o: S.CyclicLR(o, base_lr=0.01, max_lr=0.05, step_size_up=3,
                                           base_momentum=0.5, max_momentum=0.95)),
    "one_cycle_nadam": (lambda m: O.NAdam(groups(m), lr=0.01, momentum_decay=0.05),
                        lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS,
                                               base_momentum=0.5, max_momentum=0.95)),
    "one_cycle_radam_decoupled": (
        lambda m: O.RAdam(groups(m), lr=0.01, betas=(0.9, 0.9), decoupled_weight_decay=True),
        lambda o: S.OneCycleLR(o, max_lr=0.05, total_steps=STEPS, base_momentum=0.6,
                               max_momentum=0.95)),
}


def _momentum(group: dict) -> float:
    return group["betas"][0] if "betas" in group else group["momentum"]


@pytest.mark.parametrize("name", sorted(CYCLED))
def test_a_scheduler_that_cycles_momentum_or_beta1_is_followed(name):
    """The momentum (SGD, RMSprop) or beta1 (AdamW, Adamax, NAdam, RAdam) of each group is an
    input of the step, read from the torch optimizer at each step like the learning rate:
    every step's parameters match torch float64's."""
    make_opt, make_sched = CYCLED[name]
    ref, module = make_model(), make_model()
    ref_opt, opt = make_opt(ref), make_opt(module)
    ref_sched, sched = make_sched(ref_opt), make_sched(opt)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local")
    inputs = {v.name for v in trainer.step_model.graph.initializers.values()}
    assert {"ngdist.momentum", "ngdist.momentum.1"} <= inputs
    momenta = []
    # float64 through and through (torch's NAdam keeps mu_product in the default dtype):
    # within 1e-12 measured, 4.4e-11 for centered RMSprop, whose sq - avg^2 cancels
    with warnings.catch_warnings(), float64_default():
        warnings.simplefilter("error")  # no "scheduler.step() before optimizer.step()"
        for x, y in data():
            momenta.append([_momentum(g) for g in ref_opt.param_groups])
            step_both(ref, ref_opt, ref_sched, trainer, sched, x, y)
            trainer.to_torch()
            for (pname, mine), theirs in zip(module.named_parameters(), ref.parameters()):
                assert np.abs(mine.detach().numpy() - theirs.detach().numpy()).max() <= 1e-10, \
                    (pname, len(momenta))
    assert len({tuple(m) for m in momenta}) > 2  # the schedule moves the momentum
    values = trainer.state_dict()
    assert [float(values[n]) for n in ("ngdist.momentum", "ngdist.momentum.1")] == momenta[-1]
    trainer.to_torch(optimizer=opt)  # the state written back is torch's
    assert_same_state(opt, module, ref_opt, ref, 1e-9)  # (RMSprop's buffers reach 7)


def test_nadams_mu_product_moves_once_per_update_under_accumulation():
    """accumulate=2 on the same batch twice is torch's step on it: the scheduled beta1's
    mu_product (a state of the step) moves on updates only, as torch's."""
    make_opt, make_sched = CYCLED["one_cycle_nadam"]
    ref, module = make_model(), make_model()
    ref_opt, opt = make_opt(ref), make_opt(module)
    ref_sched, sched = make_sched(ref_opt), make_sched(opt)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local",
                             accumulate=2)
    with float64_default():
        for x, y in data():
            ref_opt.zero_grad()
            nn.functional.cross_entropy(ref(torch.from_numpy(x)),
                                        torch.from_numpy(y)).backward()
            ref_opt.step()
            ref_sched.step()
            for _ in range(2):
                trainer.step({"input": x, "y": y})
            sched.step()
    trainer.to_torch(optimizer=opt)
    for mine, theirs in zip(module.parameters(), ref.parameters()):
        assert np.abs(mine.detach().numpy() - theirs.detach().numpy()).max() <= 1e-10
    assert_same_state(opt, module, ref_opt, ref, 1e-10)
    assert float(trainer.state_dict()["ngdist.mu_product"]) == \
        float(ref_opt.state[ref[0].weight]["mu_product"])


def test_a_cycled_momentum_is_refused_where_ngdist_does_not_follow_it():
    module = make_model()
    opt = O.Adagrad(module.parameters(), lr=0.01)  # torch's schedulers refuse to cycle it
    opt.param_groups[0]["max_momentum"] = 0.9
    with pytest.raises(OptionError) as info:
        ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                       loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local")
    assert str(info.value) == (
        "torch.optim.Adagrad: a scheduler cycles its momentum (cycle_momentum=True), which it "
        "has not; pass cycle_momentum=False to the scheduler")
    # made after compile, the scheduler's first change of the momentum is refused
    opt = O.SGD(module.parameters(), lr=0.1, momentum=0.9)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local")
    S.OneCycleLR(opt, max_lr=0.5, total_steps=STEPS)
    x, y = data()[0]
    with pytest.raises(OptionError, match=r"^param group 0 of the torch optimizer changed "
                                          r"\['momentum'\] since ngdist.compile \(momentum: "
                                          r"0.9 -> 0.95\); ngdist follows a scheduler's "
                                          r"learning rate, and the momentum \(beta1\) that "
                                          r"OneCycleLR or CyclicLR cycles when the scheduler is "
                                          r"made before ngdist.compile$"):
        trainer.step({"input": x, "y": y})


def test_set_lr_per_group_on_an_onnx_model():
    from ngdist import zoo

    opt = ngdist.optim.AdamW(lr=0.01, groups=[{"params": ["fc0.bias", "fc1.bias"],
                                               "weight_decay": 0.0, "lr": 0.02}])
    trainer = ngdist.compile(zoo.mlp((4, 8, 3)), optimizer=opt, strategy="local")
    assert trainer.lr == {0: pytest.approx(0.02), 1: pytest.approx(0.01)}
    trainer.set_lr(0.5, group=1)
    assert trainer.lr == {0: pytest.approx(0.02), 1: 0.5}
    trainer.set_lr({0: 0.25})
    trainer.set_lr(0.125)
    assert trainer.lr == {0: 0.125, 1: 0.125}
    with pytest.raises(OptionError, match=r"no parameter group \[2\] in this step; its groups "
                                          r"are \[0, 1\]"):
        trainer.set_lr(0.1, group=2)
    with pytest.raises(OptionError, match="the learning rate takes a number, not a str"):
        trainer.set_lr("0.1")
    with pytest.raises(OptionError, match=r"must be >= 0, got -1"):
        trainer.set_lr(-1)
    assert not math.isnan(trainer.lr[0])


RANKS_SCRIPT = """
import sys
import numpy as np, torch
import ngdist
sys.path[:0] = [{tests!r}, {tests_root!r}]
from test_torch_schedules import data, groups, make_model, warmup

S = torch.optim.lr_scheduler
nn = torch.nn


def recipe(m):
    opt = torch.optim.AdamW(groups(m), lr=0.01)
    if {one_cycle!r}:  # beta1 cycled too
        return opt, S.OneCycleLR(opt, max_lr=0.05, total_steps=len(data()),
                                 base_momentum=0.6, max_momentum=0.95)
    return opt, S.LambdaLR(opt, [warmup, lambda s: 0.5 ** s])


module = make_model()
opt, sched = recipe(module)
trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                         loss=nn.CrossEntropyLoss(), optimizer=opt, timeout=60)
# 8 samples a global batch: equal shards on 2 and 4 ranks, so the mean of the ranks' mean
# gradients is the global batch's
batches = [{{"input": np.concatenate([x, x[::-1]])[:8], "y": np.concatenate([y, y[::-1]])[:8]}}
           for x, y in data()]
for batch in trainer.shard(batches):
    trainer.step(batch)
    sched.step()
trainer.to_torch()
np.savez(f"rank{{trainer.rank}}.npz", **{{n: p.detach().numpy() for n, p in
                                         module.named_parameters()}})
if trainer.rank == 0:  # torch on one process, the global batches
    ref = make_model()
    ref_opt, ref_sched = recipe(ref)
    for b in batches:
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(b["input"])),
                                    torch.from_numpy(b["y"])).backward()
        ref_opt.step()
        ref_sched.step()
    np.savez("torch.npz", **{{n: p.detach().numpy() for n, p in ref.named_parameters()}})
trainer.close()
"""


@pytest.mark.mpi
@pytest.mark.parametrize("n, one_cycle", [(2, False), (4, False), (2, True)])
def test_groups_and_a_scheduler_on_several_ranks_match_torch_on_the_global_batch(
        ranks, tmp_path, n, one_cycle):
    from pathlib import Path

    tests = str(Path(__file__).parent)
    ranks(n, RANKS_SCRIPT.format(tests=tests, tests_root=str(Path(__file__).parents[1]),
                                 one_cycle=one_cycle), timeout=150)
    want = np.load(tmp_path / "torch.npz")
    mine = [np.load(tmp_path / f"rank{r}.npz") for r in range(n)]
    for name in want:
        assert np.abs(mine[0][name] - want[name]).max() <= 1e-6, name
        for r in range(1, n):  # every rank holds the same bits
            assert mine[r][name].tobytes() == mine[0][name].tobytes(), (name, r)


def test_an_ngdist_schedule_is_refused_where_a_torch_optimizer_is_followed():
    module = make_model()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(),
                             optimizer=O.SGD(module.parameters(), lr=0.1), strategy="local")
    with pytest.raises(OptionError, match=r"follows its torch optimizer's learning rates; "
                                          r"schedule them with a torch.optim.lr_scheduler"):
        trainer.set_lr_schedule(ngdist.optim.schedules.step_decay(3))


def test_the_lr_of_each_step_is_in_its_stats_and_in_metrics_csv(tmp_path):
    import csv

    module = make_model()
    opt = O.SGD(module.parameters(), lr=0.1)
    sched = S.StepLR(opt, step_size=2, gamma=0.5)
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), optimizer=opt, strategy="local",
                             log_dir=tmp_path, log_every=2)
    stats = []
    for x, y in data()[:5]:
        stats.append(trainer.step({"input": x, "y": y}).lr)
        sched.step()
    trainer.close()
    want = [0.1, 0.1, 0.05, 0.05, 0.025]
    assert stats == pytest.approx(want, rel=1e-7)
    with open(tmp_path / "metrics.csv", newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r["split"] == "train"]
    assert [float(r["lr"]) for r in rows] == pytest.approx(want, rel=1e-6)
