"""Runs a partitioned step graph: onnxruntime sessions for compute, kernels for comm nodes.

Values live in an environment of ``OrtValue``s (name -> value), as in torch.fx's Interpreter;
each value is dropped after its last use, and every error says which segment or comm node it
came from. Comm nodes run on one background thread, in program order (the same order on every
rank), so communication overlaps with the compute segments that do not need its result.
"""
from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from ngdist.errors import CommError, ExecutionError, NgdistError
from ngdist.ir.domain import DOMAIN, PREVIEW_TRAINING
from ngdist.ir.model import IR_VERSION
from ngdist.kernels import CommNode, get_kernel
from ngdist.comm.mpi import Communicator
from ngdist.runtime.partition import CommCall, Segment, plan

logger = logging.getLogger(__name__)


def session_options(intra_op_threads: int | None = None) -> ort.SessionOptions:
    """onnxruntime options for ngdist's training sessions: ``intra_op_threads`` (one inter-op
    thread), quiet logging, and the CPU memory arena unless ``NGDIST_CPU_ARENA=0``.

    The arena is on by default: without it the CNN step of benchmarks/cnn_step_memory.py needs
    half the memory at batch 4096 but runs about 1.4x slower (docs/benchmarks.md).
    """
    opts = ort.SessionOptions()
    if intra_op_threads:
        opts.intra_op_num_threads = intra_op_threads
        opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    opts.enable_cpu_mem_arena = os.environ.get("NGDIST_CPU_ARENA", "1").strip() != "0"
    return opts

_ORT_TYPES = {
    "tensor(float)": onnx.TensorProto.FLOAT, "tensor(double)": onnx.TensorProto.DOUBLE,
    "tensor(float16)": onnx.TensorProto.FLOAT16, "tensor(bfloat16)": onnx.TensorProto.BFLOAT16,
    "tensor(int64)": onnx.TensorProto.INT64, "tensor(int32)": onnx.TensorProto.INT32,
    "tensor(int8)": onnx.TensorProto.INT8, "tensor(uint8)": onnx.TensorProto.UINT8,
    "tensor(bool)": onnx.TensorProto.BOOL, "tensor(int16)": onnx.TensorProto.INT16,
}


@dataclass
class StepTimes:
    compute: float = 0.0
    comm: float = 0.0
    wait: float = 0.0
    per_item: dict[str, float] = field(default_factory=dict)


def _attr_dict(node: onnx.NodeProto) -> dict:
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = v.decode() if isinstance(v, bytes) else v
    return out


class Executor:
    """Executes one step graph (an onnx GraphProto) again and again."""

    def __init__(self, model: onnx.ModelProto, comm: Communicator, *,
                 providers: list[str] | None = None, intra_op_threads: int | None = None,
                 overlap: bool = True) -> None:
        self.model = model
        self.comm = comm
        self.providers = providers or ["CPUExecutionProvider"]
        self.intra_op_threads = intra_op_threads
        graph = model.graph
        self.items = plan(graph)
        self.constants = {t.name: t for t in graph.initializer
                          if t.name not in {i.name for i in graph.input}}
        self.outputs = [o.name for o in graph.output]
        self.opsets = [o for o in model.opset_import if o.domain not in (DOMAIN,)]
        self.sessions: dict[int, ort.InferenceSession] = {}
        self.comm_nodes = {item.index: CommNode(item.node.op_type, item.node.name,
                                                _attr_dict(item.node), list(item.node.input),
                                                list(item.node.output))
                           for item in self.items if isinstance(item, CommCall)}
        step_outputs = {o.name for o in graph.output}
        for node in self.comm_nodes.values():  # outputs die within the step: reuse buffers
            node.state["reuse_buffer"] = not step_outputs.intersection(node.outputs)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="ngdist-comm") if overlap else None
        last: dict[str, int] = {}
        for item in self.items:
            names = item.inputs if isinstance(item, Segment) else list(item.node.input)
            for name in names:
                last[name] = item.index
        keep = set(self.outputs)
        self.free_after: dict[int, list[str]] = {}
        for name, idx in last.items():
            if name not in keep:
                self.free_after.setdefault(idx, []).append(name)
        if any(n.domain == PREVIEW_TRAINING for n in graph.node):
            raise NgdistError("the step graph still holds ai.onnx.preview.training ops; run the "
                              "pass pipeline (ngdist.passes.pipeline.run_passes) first")

    # ------------------------------------------------------------------ sessions
    def _session(self, seg: Segment, env: dict[str, ort.OrtValue]) -> ort.InferenceSession:
        sess = self.sessions.get(seg.index)
        if sess is not None:
            return sess
        inputs, inits = [], []
        for name in seg.inputs:
            if name in env:
                elem = _ORT_TYPES[env[name].data_type()]
                inputs.append(helper.make_tensor_value_info(name, elem, None))
            elif name in self.constants:
                inits.append(self.constants[name])
            else:
                raise NgdistError(f"segment {seg.index} needs value '{name}', which nothing "
                                  "produced; the step graph is inconsistent")
        outputs = [onnx.ValueInfoProto(name=o) for o in seg.outputs]
        graph = helper.make_graph(seg.nodes, f"ngdist_segment_{seg.index}", inputs, outputs,
                                  initializer=inits)
        proto = helper.make_model(graph, opset_imports=self.opsets, ir_version=IR_VERSION)
        opts = session_options(self.intra_op_threads)
        try:
            sess = ort.InferenceSession(proto.SerializeToString(), opts, providers=self.providers)
        except Exception as exc:
            raise NgdistError(f"onnxruntime rejected segment {seg.index} "
                              f"({self._describe(seg)}): {exc}") from None
        self.sessions[seg.index] = sess
        return sess

    @staticmethod
    def _describe(seg: Segment) -> str:
        names = [n.name or n.op_type for n in seg.nodes]
        return f"{len(names)} nodes, {names[0]} .. {names[-1]}"

    # ------------------------------------------------------------------ run
    def _run_comm(self, idx: int, arrays: list[np.ndarray]) -> tuple[list[np.ndarray], float]:
        node = self.comm_nodes[idx]
        t0 = time.perf_counter()
        kernel = get_kernel(node.op_type, self.comm.backend)
        try:
            out = kernel(self.comm, node, arrays)
        except NgdistError:
            raise
        except Exception as exc:
            raise CommError(f"while executing ngdist.{node.op_type} '{node.name}' on rank "
                            f"{self.comm.rank}: {exc}") from exc
        return out, time.perf_counter() - t0

    def run(self, feeds: dict[str, ort.OrtValue], times: StepTimes | None = None
            ) -> dict[str, ort.OrtValue]:
        times = times or StepTimes()
        env = dict(feeds)
        pending: dict[str, Future] = {}

        def resolve(names: list[str]) -> None:
            for name in names:
                fut = pending.get(name)
                if fut is None:
                    continue
                t0 = time.perf_counter()
                outs, dt, out_names = fut.result()
                times.wait += time.perf_counter() - t0
                times.comm += dt
                for o, arr in zip(out_names, outs):
                    env[o] = ort.OrtValue.ortvalue_from_numpy(np.asarray(arr, order="C"))
                    pending.pop(o, None)

        for item in self.items:
            if isinstance(item, Segment):
                resolve(item.inputs)
                sess = self._session(item, env)
                feed = {n: env[n] for n in item.inputs if n in env}
                t0 = time.perf_counter()
                try:
                    outs = sess.run_with_ort_values(item.outputs, feed)
                except Exception as exc:
                    raise ExecutionError(f"while executing segment {item.index} "
                                     f"({self._describe(item)}): {exc}") from None
                times.compute += time.perf_counter() - t0
                env.update(zip(item.outputs, outs))
            else:
                names = list(item.node.input)
                resolve(names)
                arrays = [env[n].numpy() for n in names]
                out_names = list(item.node.output)
                if self.pool is None:
                    outs, dt = self._run_comm(item.index, arrays)
                    times.comm += dt
                    env.update((o, ort.OrtValue.ortvalue_from_numpy(np.asarray(a, order="C")))
                               for o, a in zip(out_names, outs))
                else:
                    fut = self.pool.submit(lambda i=item.index, a=arrays, o=out_names:
                                           (*self._run_comm(i, a), o))
                    for o in out_names:
                        pending[o] = fut
            for name in self.free_after.get(item.index, ()):
                if name not in pending:
                    env.pop(name, None)
        resolve(list(pending))
        missing = [o for o in self.outputs if o not in env]
        if missing:
            raise NgdistError(f"step outputs {missing} were not produced")
        return {o: env[o] for o in self.outputs}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)
