"""The feeds of a training step: a batch checked against the step graph's data inputs (names,
ranks, fixed dimensions, a batch size baked into the model, class ids of the labels), cast to
the inputs' types and placed as OrtValues."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ngdist.errors import InputError
from ngdist.runtime.batch_checks import (batch_samples, check_label_values, infer_classes,
                                         shape_str)
from ngdist.runtime.sessions import Placement


class BatchFeeds:
    """The Trainer's step inputs, from the data inputs and label checks it sets up."""

    data_inputs: dict[str, onnx.ValueInfoProto]
    inference: onnx.ModelProto
    placement: Placement
    _model_inputs: list[str]
    _label_checks: dict[str, tuple[str, int | None, int | None]]
    _classes_by_shape: dict[tuple, dict[str, int | None]]

    def _feeds(self, batch: Mapping[str, Any]) -> tuple[dict[str, ort.OrtValue], int]:
        if not isinstance(batch, Mapping):
            raise InputError(f"step() takes a dict of input name -> array; got "
                             f"{type(batch).__name__}. Inputs: {sorted(self.data_inputs)}")
        missing = [n for n in self.data_inputs if n not in batch]
        if missing:
            raise InputError(f"the batch is missing input(s) {missing}; the model's data inputs "
                             f"are {sorted(self.data_inputs)}")
        unknown = [n for n in batch if n not in self.data_inputs]
        if unknown:
            raise InputError(f"the batch has unknown input(s) {unknown}; the model's data inputs "
                             f"are {sorted(self.data_inputs)}")
        raw = {name: np.asarray(batch[name]) for name in self.data_inputs}
        arrays: dict[str, np.ndarray] = {}
        for name, info in self.data_inputs.items():
            tt = info.type.tensor_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type)
            if name in self._label_checks:  # before the cast hides 2.5 as 2
                check_label_values(name, raw[name], None, *self._label_checks[name])
            arr = np.ascontiguousarray(raw[name], dtype=dtype)
            if tt.HasField("shape"):
                dims = tt.shape.dim
                if arr.ndim != len(dims):
                    raise InputError(f"input '{name}' has shape {arr.shape}, the model expects "
                                     f"rank {len(dims)} ({shape_str(dims)})")
                for axis, d in enumerate(dims):
                    if axis and d.HasField("dim_value") and arr.shape[axis] != d.dim_value:
                        raise InputError(f"input '{name}' has shape {arr.shape}; the model "
                                         f"expects {shape_str(dims)} (axis {axis})")
            arrays[name] = arr
        sizes = {n: a.shape[0] for n, a in arrays.items() if a.ndim}
        samples = batch_samples(sizes, "the batch")  # per-token rows: a multiple of it
        self._check_fixed_batch(arrays)
        run_time = self._run_time_classes(arrays)
        for name, (scores, ignore_index, classes) in self._label_checks.items():
            check_label_values(name, raw[name], arrays[name], scores, ignore_index,
                                classes or run_time.get(name))
        feeds = {name: self.placement.value(arr) for name, arr in arrays.items()}
        return feeds, samples

    def _run_time_classes(self, arrays: Mapping[str, np.ndarray]) -> dict[str, int | None]:
        """The classes that the graphs leave unknown (a dynamic last dimension), from shape
        inference of the forward graph with this batch's input shapes (once per shape)."""
        unknown = {n: c[0] for n, c in self._label_checks.items() if c[2] is None}
        if not unknown:
            return {}
        key = tuple(arrays[n].shape for n in self._model_inputs)
        if key not in self._classes_by_shape:
            if len(self._classes_by_shape) >= 16:
                self._classes_by_shape.clear()
            self._classes_by_shape[key] = infer_classes(
                self.inference, {n: arrays[n].shape for n in self._model_inputs}, unknown)
        return self._classes_by_shape[key]

    def _check_fixed_batch(self, arrays: Mapping[str, np.ndarray]) -> None:
        """A batch size baked into the model (a static axis 0) that the shard does not have is
        reported on the model's input, whichever value (often the labels) inherited it."""
        for name, info in self.data_inputs.items():
            tt, arr = info.type.tensor_type, arrays[name]
            if not (tt.HasField("shape") and tt.shape.dim and arr.ndim):
                continue
            d = tt.shape.dim[0]
            if d.HasField("dim_value") and arr.shape[0] != d.dim_value:
                shown = name if name in self._model_inputs else self._model_inputs[0]
                raise InputError(f"input '{shown}' has a fixed batch size of {d.dim_value} in "
                                 f"the model; this rank's shard has {arr.shape[0]} samples: "
                                 "export the model with a dynamic batch axis")
