"""Comm items through their kernels: values handed over as views, results wrapped back.

A kernel reads arrays in the memory it declares and returns arrays; an input it hands back is
its own value again, a new array is wrapped without a copy. ``host`` memory on the CPU: views
of the values' memory, no copy, through DLPack (``np.from_dlpack``, as ``cupy.from_dlpack``
on a device), read-only, for an input the kernel must not write, and the writable
``OrtValue.numpy()`` view (the same memory) for a donated input, which it may reduce in place:
numpy marks every array imported from onnxruntime 1.31's DLPack capsule read-only (its
``__dlpack__`` takes no ``max_version``, so numpy falls back to the unversioned capsule, which
has no read-only flag to say otherwise). A bfloat16 value is a ``uint16`` view of its bits. A kernel
may ask for the next step's input in memory of its own (a ``WriteInto`` request in
``node.requests``): :meth:`CommRunner.memory_for` gives the segment that makes that input an
OrtValue over it.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ngdist.comm.group import ProcessGroup
from ngdist.errors import CommError, NgdistError
from ngdist.ir.domain import NO_BUCKET
from ngdist.kernels import KernelSpec
from ngdist.kernels.base import donated
from ngdist.runtime.inplace_planner import BFLOAT16
from ngdist.runtime.plan import StepPlan
from ngdist.runtime.sessions import Placement, out_of_memory
from ngdist.runtime.timing import span


def device_module(placement: Placement) -> Any:
    """The array module of the placement's device memory (cupy for CUDA), or None: on the
    CPU (numpy views of the values serve), or where it is not installed (host copies do)."""
    if placement.device == "cpu":
        return None
    try:
        import cupy  # noqa: PLC0415 - only on a device placement
    except ImportError:
        return None
    return cupy


class CommRunner:
    """Runs the comm items of one plan through ``group``."""

    def __init__(self, plan: StepPlan, group: ProcessGroup, placement: Placement) -> None:
        self.plan = plan
        self.group = group
        self.placement = placement
        self.kernels: dict[int, KernelSpec] = dict(plan.kernels)
        self.device_module = device_module(placement)
        self._comm_input = dict(plan.comm_input)  # (read for every segment output)
        # value name -> {id of an array its kernel asked for: (the array, an OrtValue over it)}
        self._kernel_values: dict[str, dict[int, tuple[Any, ort.OrtValue]]] = {}
        self.timeline: Any = None

    def memory_for(self, name: str) -> ort.OrtValue | None:
        """The memory a comm kernel asked value ``name`` to be written into for its next
        call, as an OrtValue made once per array (a kernel may hand out two in turn; a third
        array replaces them); None when it asked for nothing."""
        spot = self._comm_input.get(name)
        if spot is None:
            return None
        index, i = spot
        array = next((r.array for r in self.plan.comm_nodes[index].requests if r.index == i),
                     None)
        if array is None:
            return None
        made_for = self._kernel_values.setdefault(name, {})
        made = made_for.get(id(array))
        if made is None or made[0] is not array:
            if len(made_for) >= 2:
                made_for.clear()
            made = made_for[id(array)] = (array, self.placement.value(array))
        return made[1]

    def views(self, spec: KernelSpec, values: Sequence[ort.OrtValue],
              writable: Sequence[bool]) -> list[Any]:
        """The kernel's inputs: views of the values' memory (on a device, DLPack views in the
        placement's array module for a kernel that takes any memory; on the CPU, read-only
        DLPack views but where ``writable[i]``: a donated input), staged to the host only
        when the kernel reads host memory and the values live on a device."""
        xp = self.device_module
        if spec.memory == "any" and xp is not None:
            return [xp.from_dlpack(v) for v in values]
        if spec.memory in ("host", "any") and self.placement.device == "cpu":
            return [self._bits(v) if v.data_type() == BFLOAT16 else
                    v.numpy() if w else np.from_dlpack(v) for v, w in zip(values, writable)]
        if spec.memory in ("host", "any"):  # from a device: a host copy
            return [v.numpy() for v in values]
        raise NgdistError(f"ngdist.{spec.op_type} has a {spec.memory}-memory kernel, which "
                          f"the {self.placement.device} placement cannot feed")

    def _bits(self, value: ort.OrtValue) -> np.ndarray:
        """A writable ``uint16`` view of a bfloat16 value's memory on the CPU."""
        if self.placement.device != "cpu":
            raise NgdistError(f"bfloat16 values reach host kernels only on the CPU placement, "
                              f"not {self.placement.device!r}; use compression='fp16' there")
        shape = tuple(value.shape())
        count = int(np.prod(shape, dtype=np.int64))
        if count == 0:
            return np.empty(shape, np.uint16)
        memory = (ctypes.c_uint16 * count).from_address(value.data_ptr())
        return np.ctypeslib.as_array(memory).reshape(shape)

    def wrap(self, outs: Sequence[Any], inputs: Sequence[Any],
             values: Sequence[ort.OrtValue]) -> list[ort.OrtValue]:
        """Kernel results as OrtValues: an input handed back is its own value again; a new
        array is wrapped without a copy (on CPU), as bfloat16 where input i of the same
        position was (the kernel returns its bits as ``uint16``)."""
        wrapped = []
        on_cpu = self.placement.device == "cpu"
        for i, out in enumerate(outs):
            same = next((v for x, v in zip(inputs, values) if x is out), None) if on_cpu \
                else None
            if same is None and not isinstance(out, np.ndarray):  # a device array
                same = ort.OrtValue.from_dlpack(out)  # (takes the array, as in 1.31)
            if same is None:
                out = out if out.flags.c_contiguous else np.array(out, order="C")
                bf16 = out.dtype == np.uint16 and i < len(values) and \
                    values[i].data_type() == BFLOAT16
                same = self.placement.value(out, onnx.TensorProto.BFLOAT16 if bf16 else None)
            wrapped.append(same)
        return wrapped

    def run(self, indices: Sequence[int], values: Sequence[ort.OrtValue]
            ) -> tuple[list[ort.OrtValue], float]:
        """Comm items ``indices`` (one, or a batch) on ``values``, the inputs of each in
        turn; their outputs in the same order, and the time taken."""
        nodes = [self.plan.comm_nodes[i] for i in indices]
        spec = self.kernels[indices[0]]
        sent0 = self.group.bytes_sent
        took: list[float] = []
        with span(self.timeline, "comm", " + ".join(n.name for n in nodes), took) as args:
            inputs = self.views(spec, values, [donated(n, i) for n in nodes
                                               for i in range(len(n.inputs))])
            outs = self._call(spec, nodes, inputs)
            wrapped = self.wrap(outs, inputs, values)
            if self.timeline is not None:
                args.update(self._args(spec, nodes, self.group.bytes_sent - sent0))
        return wrapped, took[0]

    def _call(self, spec: KernelSpec, nodes: list[Any], inputs: list[Any]) -> list[Any]:
        try:
            if len(nodes) == 1:
                return spec(self.group, nodes[0], inputs)
            split, at = [], 0
            for node in nodes:
                split.append(inputs[at:at + len(node.inputs)])
                at += len(node.inputs)
            return [o for each in spec.batch(self.group, nodes, split) for o in each]
        except NgdistError:
            raise
        except Exception as exc:
            names = ", ".join(f"'{node.name}'" for node in nodes)
            oom = out_of_memory(f"ngdist.{spec.op_type} {names} on rank {self.group.rank}",
                                exc)  # (numpy's MemoryError: a buffer of the kernel)
            if oom is not None:
                raise oom from None
            raise CommError(f"while executing ngdist.{spec.op_type} {names} on rank "
                            f"{self.group.rank}: {exc}") from exc

    def _args(self, spec: KernelSpec, nodes: list[Any], sent: int) -> dict[str, Any]:
        """What the timeline says of a comm span (with the implementation that ran it)."""
        buckets = [None if n.attributes.get("bucket", NO_BUCKET) == NO_BUCKET
                   else n.attributes["bucket"] for n in nodes]
        return {"op": nodes[0].op_type, "bytes": sent,
                "algorithm": nodes[0].attributes.get("algorithm"),
                "bucket": buckets if len(nodes) > 1 else buckets[0],
                "values": [x for n in nodes for x in n.inputs], "group_size": self.group.size,
                "implementation": None if spec.explain is None
                else spec.explain(nodes[0], self.group)[0]}

    def drain(self) -> dict[str, np.ndarray]:
        """Complete communication that kernels keep in flight across steps (PushSum with
        overlap): what it brings, by comm-node output name, to be added to the values."""
        extra: dict[str, np.ndarray] = {}
        for idx, node in self.plan.comm_nodes.items():
            spec = self.kernels[idx]
            if spec.drain is not None:
                got = spec.drain(self.group, node)
                extra.update(zip(node.outputs, got or ()))
        return extra

    def close(self) -> None:
        for idx, node in self.plan.comm_nodes.items():
            spec = self.kernels[idx]
            if spec.close is not None:
                spec.close(node)
