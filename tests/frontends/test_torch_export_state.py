"""Exporting a module leaves it as it was: the same parameter and buffer objects with the same
values (tracing in training mode moves BatchNorm statistics, the eval export fills tensors with
marker values), its training flag, and its state dict's ``_metadata`` (module versions) --
restoring through ``load_state_dict`` without that metadata broke modules that check their
version, torchvision's MNASNet among them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import ngdist
from ngdist.zoo_vision import import_torchvision
from step_probe import check_step_graph

nn = torch.nn


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _state(module: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {k: (v, v.detach().clone()) for k, v in module.state_dict(keep_vars=True).items()}


def _assert_untouched(module: nn.Module, before: dict, metadata: dict) -> None:
    after = module.state_dict(keep_vars=True)
    assert list(after) == list(before)
    for name, (tensor, value) in before.items():
        assert after[name] is tensor, name  # the same object, so optimizers keep working
        assert torch.equal(after[name].detach(), value), name
    assert dict(module.state_dict()._metadata) == metadata


class Versioned(nn.Module):
    """A module that, like torchvision's MNASNet, refuses a state dict without its version."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 3), nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.fc(x))

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        version = local_metadata.get("version", None)
        if version != 2:
            raise ValueError(f"version should be 2 instead of {version}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


def test_versioned_module_compiles_and_keeps_its_state():
    torch.manual_seed(0)
    module = Versioned().eval()
    before, metadata = _state(module), dict(module.state_dict()._metadata)
    assert metadata[""]["version"] == 2
    trainer = ngdist.compile(module, torch.zeros(4, 6), loss=nn.CrossEntropyLoss(),
                             strategy="local", optimizer="sgd:lr=0.01")
    check_step_graph(trainer.step_model)
    _assert_untouched(module, before, metadata)
    assert not module.training
    module.load_state_dict(module.state_dict())  # still loads: the metadata is there
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    trainer.step({"x": x, "y": np.array([0, 1, 2, 0])})
    trainer.to_torch()
    assert module.fc.weight is before["fc.weight"][0]
    assert not torch.equal(module.fc.weight, before["fc.weight"][1])


def test_torchvision_mnasnet_compiles_and_its_state_is_untouched():
    tv = import_torchvision()
    torch.manual_seed(0)
    module = tv.models.mnasnet0_5(num_classes=4)
    before, metadata = _state(module), dict(module.state_dict()._metadata)
    assert metadata[""]["version"] == 2  # MNASNet refuses a state dict without it
    trainer = ngdist.compile(module, torch.zeros(2, 3, 32, 32), loss=nn.CrossEntropyLoss(),
                             strategy="local", optimizer=torch.optim.SGD(module.parameters(),
                                                                         lr=0.01))
    check_step_graph(trainer.step_model)
    _assert_untouched(module, before, metadata)
    assert module.training
    module.load_state_dict(module.state_dict())  # torchvision's own check passes
    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    stats = trainer.step({"x": x, "y": np.array([1, 3])})
    assert np.isfinite(stats.loss)
