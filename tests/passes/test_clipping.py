"""Gradient clipping (passes/clipping.py) against torch.nn.utils.clip_grad_norm_ and
clip_grad_value_ in float64: one process, and 2 ranks under mpiexec against torch on the
combined batch (every rank clips by the global norm: the same bytes on both); the norm before
clipping in the step stats and metrics.csv; the refusals."""
from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch

import ngdist
from ngdist.errors import OptionError

nn = torch.nn
STEPS, LR, MAX_NORM, MAX_VALUE = 3, 0.5, 0.3, 0.02


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 4)).double()


def batch(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(step)
    return {"input": rng.standard_normal((8, 6)) * 3, "y": rng.integers(0, 4, 8)}


def torch_run(clip: str) -> tuple[dict[str, np.ndarray], list[float]]:
    """torch on the whole batches: parameters after STEPS and the norms before clipping."""
    ref = make_model()
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=0.9)
    norms = []
    for s in range(STEPS):
        b = batch(s)
        opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.from_numpy(b["input"])),
                                    torch.from_numpy(b["y"])).backward()
        if clip == "norm":
            norms.append(float(nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)))
        else:
            nn.utils.clip_grad_value_(ref.parameters(), MAX_VALUE)
        opt.step()
    return {k: v.detach().numpy() for k, v in ref.state_dict().items()}, norms


def options(clip: str) -> dict[str, float]:
    return {"clip_grad_norm": MAX_NORM} if clip == "norm" else {"clip_grad_value": MAX_VALUE}


@pytest.mark.parametrize("clip", ["norm", "value"])
def test_local_clipping_follows_torch(clip):
    module = make_model()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(), strategy="local",
                             optimizer=torch.optim.SGD(module.parameters(), lr=LR, momentum=0.9),
                             **options(clip))
    norms = [trainer.step(batch(s)).grad_norm for s in range(STEPS)]
    expected, expected_norms = torch_run(clip)
    if clip == "norm":
        np.testing.assert_allclose(norms, expected_norms, rtol=1e-8)  # float32 momentum
        assert min(expected_norms) > MAX_NORM  # every step clips
    else:
        assert norms == [None] * STEPS
    params = trainer.parameters()
    for k, v in expected.items():
        # float64 but for ONNX Momentum's float32 attributes
        np.testing.assert_allclose(params[k], v, rtol=0, atol=1e-7, err_msg=k)
    unclipped = make_model()
    plain = ngdist.compile(unclipped, torch.zeros(2, 6, dtype=torch.float64),
                           loss=nn.CrossEntropyLoss(), strategy="local",
                           optimizer=torch.optim.SGD(unclipped.parameters(), lr=LR, momentum=0.9))
    for s in range(STEPS):
        plain.step(batch(s))
    assert max(np.abs(plain.parameters()[k] - v).max() for k, v in expected.items()) > 1e-3


SCRIPT = """
import sys

import numpy as np
import torch

sys.path.insert(0, sys.argv[1])
import ngdist
import test_clipping as T

for clip in ("norm", "value"):
    module = T.make_model()
    trainer = ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64),
                             loss=torch.nn.CrossEntropyLoss(), log_dir=f"logs-{clip}",
                             log_every=1, **T.options(clip),
                             optimizer=torch.optim.SGD(module.parameters(), lr=T.LR,
                                                       momentum=0.9))
    norms = []
    for s in range(T.STEPS):
        (mine,) = trainer.shard([T.batch(s)])
        norms.append(trainer.step(mine).grad_norm or 0.0)
    trainer.close()
    np.savez(f"{clip}.{trainer.rank}.npz", norms=np.array(norms), **trainer.parameters())
"""


@pytest.mark.mpi
def test_two_ranks_clip_by_the_global_norm(ranks, tmp_path):
    ranks(2, SCRIPT, args=[str(Path(__file__).parent)], timeout=200)
    for clip in ("norm", "value"):
        expected, expected_norms = torch_run(clip)
        got = [dict(np.load(tmp_path / f"{clip}.{r}.npz")) for r in range(2)]
        for k, v in expected.items():
            assert got[1][k].tobytes() == got[0][k].tobytes(), (clip, k)
            np.testing.assert_allclose(got[0][k], v, rtol=0, atol=1e-7, err_msg=f"{clip} {k}")
        assert got[1]["norms"].tobytes() == got[0]["norms"].tobytes()
        with open(tmp_path / f"logs-{clip}" / "metrics.csv") as f:
            logged = [row["grad_norm"] for row in csv.DictReader(f) if row["split"] == "train"]
        if clip == "norm":
            np.testing.assert_allclose(got[0]["norms"], expected_norms, rtol=1e-8)
            np.testing.assert_allclose([float(v) for v in logged], expected_norms, rtol=1e-6)
        else:
            assert logged == [""] * STEPS


@pytest.mark.parametrize("strategy", ["ps", "pushsum"])
def test_a_global_norm_without_an_averaged_gradient_is_refused(strategy):
    module = make_model()
    with pytest.raises(OptionError, match=rf"clip_grad_norm cannot run under strategy "
                                          rf"'{strategy}': .* use clip_grad_value"):
        ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), strategy=strategy,
                       optimizer=torch.optim.SGD(module.parameters(), lr=LR),
                       loss=nn.CrossEntropyLoss(), clip_grad_norm=1.0)


@pytest.mark.parametrize("kwargs, message", [
    ({"clip_grad_norm": "1.0"}, r"option 'clip_grad_norm' of ngdist.compile takes a number or "
                                r"None, got '1.0' \(str\)"),
    ({"clip_grad_norm": -1.0}, r"clip_grad_norm must be a positive number, got -1.0"),
    ({"clip_grad_norm": 1.0, "clip_grad_value": 0.1}, r"clip_grad_norm and clip_grad_value are "
                                                      r"both given"),
    ({"clip_grad_nrom": 1.0}, r"did you mean 'clip_grad_norm'"),
])
def test_bad_clipping_options_are_refused(kwargs, message):
    module = make_model()
    with pytest.raises(OptionError, match=message):
        ngdist.compile(module, torch.zeros(2, 6, dtype=torch.float64), strategy="local",
                       optimizer=torch.optim.SGD(module.parameters(), lr=LR),
                       loss=nn.CrossEntropyLoss(), **kwargs)
