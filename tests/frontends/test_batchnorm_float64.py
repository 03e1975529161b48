"""A float64 torch model with BatchNorm1d trains like torch float64: the running variance's
unbiased correction (frontends/cleanup.py) computes in the input's float type."""
from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn as nn

import ngdist


def test_float64_batchnorm_steps_and_matches_torch():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(),
                           nn.Linear(8, 3)).double()
    ref = copy.deepcopy(module)
    trainer = ngdist.compile(module, torch.zeros(4, 6, dtype=torch.float64),
                             loss=nn.CrossEntropyLoss(),
                             optimizer=torch.optim.SGD(module.parameters(), lr=0.1),
                             strategy="local")
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    rng = np.random.default_rng(0)
    for _ in range(3):
        x, y = rng.standard_normal((5, 6)), rng.integers(0, 3, 5)
        trainer.step({"input": x, "y": y})
        ref_opt.zero_grad()
        nn.functional.cross_entropy(ref(torch.tensor(x)), torch.tensor(y)).backward()
        ref_opt.step()
    got = trainer.state_dict()
    want = {k: v.numpy() for k, v in ref.state_dict().items() if k in got}
    assert {"1.running_mean", "1.running_var", "0.weight"} <= set(want)
    for name, value in want.items():
        assert got[name].dtype == np.float64, name
        # ONNX keeps BatchNorm's momentum and the learning rate as float32 values
        np.testing.assert_allclose(got[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
