"""The write-back a framework frontend hands to the Trainer (ngdist/ir/writeback.py):
``trainer.to_torch()`` / ``to_keras()`` call it with the trainer's values, and refuse clearly
on a trainer compiled from another kind of model."""
from __future__ import annotations

import numpy as np
import pytest

import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import NgdistError
from ngdist.ir.model import split_training_model
from ngdist.ir.writeback import WriteBack
from ngdist.passes.pipeline import run_passes
from ngdist.runtime.trainer import Trainer

X, Y, _, _ = load_digits()


def _trainer(write_back: WriteBack | None) -> Trainer:
    model = ngdist.to_training_model(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1))
    inference, step = split_training_model(model)
    return Trainer(inference, step=run_passes(step, "local"), write_back=write_back)


def test_to_torch_calls_the_write_back_with_the_trained_values():
    calls = []

    def write(values, steps_done, /, *args, **kwargs):
        calls.append((values, steps_done, args, kwargs))
        return "the module"

    tr = _trainer(WriteBack("torch", write, export="names"))
    for i in range(3):
        tr.step({"x": X[i * 8:(i + 1) * 8], "y": Y[i * 8:(i + 1) * 8]})
    assert tr.to_torch() == "the module"
    assert tr.to_torch("other", optimizer="opt") == "the module"
    (values, steps, args, kwargs), (_, _, args2, kwargs2) = calls
    expected = tr.state_dict()
    assert sorted(values) == sorted(expected)
    assert all(np.array_equal(values[k], expected[k]) for k in expected)
    assert (steps, args, kwargs) == (3, (None,), {})
    assert (args2, kwargs2) == (("other",), {"optimizer": "opt"})
    with pytest.raises(NgdistError) as exc:
        tr.to_keras()
    assert str(exc.value) == ("to_keras() needs a trainer compiled from a Keras model; this one "
                              "was compiled from a torch.nn.Module")
    tr.close()


def test_a_trainer_compiled_from_onnx_has_nothing_to_write_back():
    tr = _trainer(None)
    with pytest.raises(NgdistError) as exc:
        tr.to_torch()
    assert str(exc.value) == ("to_torch() needs a trainer compiled from a torch.nn.Module; "
                              "this one was compiled from an ONNX model")
    with pytest.raises(NgdistError) as exc:
        tr.to_keras()
    assert str(exc.value) == ("to_keras() needs a trainer compiled from a Keras model; this one "
                              "was compiled from an ONNX model")
    tr.close()


def test_a_zero_dimensional_parameter_trains_and_writes_back_with_its_momentum():
    """A 0-d parameter (moonshine's log_k) is written back as 0-d, and its optimizer state
    too, each as torch's own two SGD steps reach them."""
    import copy

    import torch

    class Scaled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)
            self.log_k = torch.nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return self.fc(x * torch.exp(self.log_k))

    torch.manual_seed(0)
    module, x, y = Scaled(), torch.randn(5, 4), torch.randint(0, 3, (5,))
    ref = copy.deepcopy(module).double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    trainer = ngdist.compile(module, [x], loss=torch.nn.CrossEntropyLoss(), optimizer=opt,
                             strategy="local", input_names=["x"])
    for _ in range(2):
        trainer.step({"x": x.numpy(), "y": y.numpy()})
        ref_opt.zero_grad()
        torch.nn.functional.cross_entropy(ref(x.double()), y).backward()
        ref_opt.step()
    trainer.to_torch()
    assert module.log_k.shape == () and opt.state[module.log_k]["momentum_buffer"].shape == ()
    assert abs(float(module.log_k) - float(ref.log_k)) < 1e-6
    assert abs(float(opt.state[module.log_k]["momentum_buffer"]) -
               float(ref_opt.state[ref.log_k]["momentum_buffer"])) < 1e-6
