"""A Trainer's state from outside: the parameters and everything the step updates or reads as
numpy arrays (pushsum's values de-biased), loading them back, the trained model as ONNX (file
or ModelProto), ps's owners' optimizer state gathered, and the write-back into the torch module
or Keras model compiled from."""
from __future__ import annotations

import ctypes
import functools
import gc
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from ngdist.errors import NgdistError
from ngdist.ir.domain import GRAD_SCALE
from ngdist.ir.model import TENSOR_DATA, StepMeta, assemble_training_model, save_proto
from ngdist.ir.writeback import WriteBack
from ngdist.runtime import ps_server
from ngdist.runtime.executor import Executor
from ngdist.runtime.replicas import ReplicatedExecutor
from ngdist.runtime.sessions import Placement

logger = logging.getLogger(__name__)


def without_data(step: ir.Model, names: set[str],
                 current: Callable[[str], np.ndarray] | None = None, keep: bool = False
                 ) -> ir.Model:
    """A fresh copy of ``step`` whose initializers ``names`` hold no data: with ``current``
    (a value by name), tensors of their type and shape that read it when used (the graph
    stays valid ONNX); without, empty tensors. Their data is never copied; ``step`` loses it
    too (its memory is freed once nothing else holds it) unless ``keep``."""
    inits = step.graph.initializers
    kinds, held = {}, {}
    for n in names & set(inits):
        value = held[n] = inits[n].const_value
        kinds[n] = (value.dtype, ir.Shape(list(value.shape)))  # type: ignore[union-attr]
        inits[n].const_value = ir.tensor(np.zeros(0, kinds[n][0].numpy()), name=n)
    try:
        fresh = ir.from_proto(ir.to_proto(step))
    finally:
        for n, value in held.items() if keep else ():
            inits[n].const_value = value
    if current is not None:
        for n, (dtype, shape) in kinds.items():
            fresh.graph.initializers[n].const_value = ir.LazyTensor(
                functools.partial(_read, current, n), dtype, shape, name=n)
    return fresh


def _read(current: Callable[[str], np.ndarray], name: str) -> ir.Tensor:
    return ir.tensor(current(name), name=name)


def release_freed_memory() -> None:
    """Collects garbage and hands the C heap's free pages back to the system (glibc's
    ``malloc_trim``; nothing elsewhere): start-up's whole-model copies are freed, but without
    it the process keeps their pages resident."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (AttributeError, OSError):  # not glibc
        pass


class StateAccess:
    """The Trainer's values read, loaded, saved and written back."""

    values: dict[str, ort.OrtValue]
    placement: Placement
    inference: onnx.ModelProto
    step_model: ir.Model
    meta: StepMeta
    executor: Executor | ReplicatedExecutor
    debias: dict[str, str]
    steps_done: int
    role: str
    rank: int
    _sessions: tuple[int, dict[str | None, ort.InferenceSession]]
    _state_synced_at: int
    _write_back: WriteBack | None

    def _drop_template_data(self, names: set[str]) -> None:
        """The data of ``names`` (values the trainer holds) dropped from the models it keeps
        as templates (the inference model, the step graph), which are filled with the current
        values when used: a rank holds one copy of its values, not a whole copy beside them.
        Hyperparameters stay (set_lr_schedule reads its base from the step graph)."""
        names = {n for n in names if self.meta.roles.get(n) != "hyper"}
        for t in self.inference.graph.initializer:
            if t.name in names:
                for f in TENSOR_DATA:
                    t.ClearField(f)
        # fresh copies: a tensor read from a proto keeps the whole proto it came from alive
        # (the protobuf arena), so one constant left would keep every dropped tensor's memory
        inference = onnx.ModelProto()
        inference.ParseFromString(self.inference.SerializeToString())
        self.inference = inference
        self.step_model = without_data(self.step_model, names,
                                       lambda n: self.values[n].numpy())
        release_freed_memory()

    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters (de-biased under pushsum), by initializer name.
        Under ``shard="parameters"``: gathered, collective (call it on every rank)."""
        values = self._deployable()
        sharding = getattr(self, "sharding", None)
        names = sharding.parameter_names if sharding is not None else []
        return {n: np.array(values[n]) for n in [*self.meta.names("param"), *names]
                if n in values}

    def _deployable(self) -> dict[str, np.ndarray]:
        """Current values with pushsum's numerators replaced by z = x / w (and w by 1); under
        ``shard="parameters"`` the parameters gathered whole (collective)."""
        values = {n: v.numpy() for n, v in self.values.items()}
        sharding = getattr(self, "sharding", None)
        if sharding is not None:  # runtime/sharding.py
            values = sharding.expand(self, values)
        for p, w in self.debias.items():
            values[p] = (values[p] / values[w]).astype(values[p].dtype)
        for w in set(self.debias.values()):
            values[w] = np.ones_like(values[w])
        if GRAD_SCALE in values:  # the runtime sets it from the rank count; files hold 1
            values[GRAD_SCALE] = np.ones_like(values[GRAD_SCALE])
        return values

    def flush(self) -> None:
        """Complete communication still in flight (pushsum with overlap) and add what it
        brings to the bound values. Call it on every rank, e.g. before reading state_dict()."""
        bound = {out: name for name, out in self.meta.binding.items()}
        for out, arr in self.executor.drain().items():
            name = bound[out]
            self.values[name] = self.placement.value(np.asarray(self.values[name].numpy() + arr))
            self._sessions = (-1, {})

    def state_dict(self) -> dict[str, np.ndarray]:
        """Copies of everything the step updates or reads (params, buffers, optimizer state,
        hyper-parameters), without ``ngdist.grad_scale``, which the runtime sets from the
        number of ranks. Sharded (``shard=``): whole per-parameter tensors, gathered
        (collective: call it on every rank)."""
        sharding = getattr(self, "sharding", None)
        if sharding is not None:  # runtime/sharding.py
            return sharding.full_state(self)
        return {n: v.numpy().copy() for n, v in self.values.items() if n != GRAD_SCALE}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        state = {n: v for n, v in state.items() if n != GRAD_SCALE}  # a fact of this job
        sharding = getattr(self, "sharding", None)
        whole = sharding.whole_names() if sharding is not None else set()
        unknown = set(state) - set(self.values) - whole
        if unknown:
            raise KeyError(f"unknown names in state: {sorted(unknown)}")
        if sharding is not None:  # whole tensors: each rank takes its slices
            sharding.load_state(self, state)
            return
        for n, v in state.items():
            self.values[n] = self.placement.value(
                np.array(v, dtype=self.values[n].numpy().dtype))

    def to_onnx(self) -> onnx.ModelProto:
        """The training model with the current values: deployable graph + training_info
        (sharded: the standard model, gathered; collective)."""
        sharding = getattr(self, "sharding", None)
        if sharding is not None:
            return sharding.full_model(self)
        return assemble_training_model(self.inference, self.step_model, self._deployable())

    def sync_state(self) -> None:
        """Collective over the workers; needed only under ``ps``.

        There the optimizer state (momentum, Adam moments) lives with the shard owners, and a
        worker's own copy stays as it was at start-up. This gathers the owners' live state into
        rank 0's values, so that ``save()`` and ``state_dict()`` on rank 0 hold it. Call it on
        every worker (dedicated servers answer it by themselves) before saving; with other
        strategies it does nothing.
        """
        rt = ps_server.runtime(self)
        if rt is None or (self.role == "server" and not rt.lockstep):
            return
        owned = ps_server.gather_state(self)
        if owned:
            self.load_state_dict(owned)
        self._state_synced_at = self.steps_done

    def save(self, path: str | os.PathLike, all_ranks: bool = False) -> None:
        """Writes the trained model atomically; by default only rank 0 writes (ranks agree).
        Under ``ps``, call ``sync_state()`` on every worker first to include the live
        optimizer state. Sharded (``shard=``): collective, call it on every rank; the file is
        the standard model with the optimizer state gathered (runtime/sharding.py)."""
        sharding = getattr(self, "sharding", None)  # ZeRO: gathered on every rank
        full = self.to_onnx() if sharding is not None else None
        if self.rank == 0 or all_ranks:
            if self.steps_done != self._state_synced_at and self.role == "worker":
                if ps_server.runtime(self) is not None:
                    logger.warning(
                        "ps: %s gets the parameters of step %d but the optimizer state of step "
                        "%d (it lives with the shard owners); call trainer.sync_state() on "
                        "every worker before save() to include it", path, self.steps_done,
                        self._state_synced_at)
            save_proto(full if full is not None else self.to_onnx(), path)

    def to_torch(self, module: Any = None, **kwargs: Any) -> Any:
        """Writes the trained parameters and buffers into the torch module this trainer was
        compiled from (or ``module``), and the optimizer state into a torch optimizer
        (``optimizer=``, by default the one compiled with). Returns the module. Sharded
        (``shard=``): collective, call it on every rank."""
        if self._write_back is None or self._write_back.framework != "torch":
            source = "a Keras model" if self._write_back else "an ONNX model"
            raise NgdistError(f"to_torch() needs a trainer compiled from a torch.nn.Module; "
                              f"this one was compiled from {source}")
        return self._write_back(self.state_dict(), self.steps_done, module, **kwargs)

    def to_keras(self, model: Any = None) -> Any:
        """Writes the trained weights into the Keras model this trainer was compiled from (or
        ``model``). Returns the model."""
        if self._write_back is None or self._write_back.framework != "keras":
            source = "a torch.nn.Module" if self._write_back else "an ONNX model"
            raise NgdistError(f"to_keras() needs a trainer compiled from a Keras model; this "
                              f"one was compiled from {source}")
        return self._write_back(self.state_dict(), self.steps_done, model)
