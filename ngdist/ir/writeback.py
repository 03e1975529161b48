"""The link back from a training model to the framework object it was exported from.

A framework frontend (frontends/torch.py, frontends/keras.py) returns a training model and a
``WriteBack``; ``ngdist.compile`` hands the write-back to the Trainer, whose ``to_torch()`` /
``to_keras()`` call it with the trainer's current values. The type lives here, in the layer
every other one imports, so that the frontends never import the API layer or the trainer and
the runtime never imports a frontend: the frontend knows how ONNX names map to the framework's
variables, the trainer knows the values, and neither knows the other.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


class WriteFn(Protocol):
    """Writes ``values`` (name -> array, the trainer's ``state_dict()``) into the framework
    object; ``steps_done`` is the number of steps the trainer ran (e.g. for torch's
    ``num_batches_tracked``). Extra arguments come from ``to_torch(...)``/``to_keras(...)``."""

    def __call__(self, values: Mapping[str, np.ndarray], steps_done: int, /, *args: Any,
                 **kwargs: Any) -> Any: ...


@dataclass(frozen=True)
class WriteBack:
    """How trained values return to the framework: ``framework`` is ``"torch"`` or ``"keras"``,
    ``write`` does it, ``export`` is the frontend's record of the export (names, layouts);
    ``hypers``, when given, reads the framework optimizer's learning rate (and scheduled
    momentum) of every parameter group as {step value name: value} (``ngdist.ir.hyper``),
    which the trainer follows at each step (runtime/hyper.py)."""

    framework: str
    write: WriteFn
    export: Any = None
    hypers: Callable[[], Mapping[str, float]] | None = None

    def __call__(self, values: Mapping[str, np.ndarray], steps_done: int, /, *args: Any,
                 **kwargs: Any) -> Any:
        return self.write(values, steps_done, *args, **kwargs)
