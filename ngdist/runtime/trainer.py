"""The Trainer: holds parameters and optimizer state as OrtValues and runs training steps."""
from __future__ import annotations

import copy
import logging
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper

from ngdist.comm import ProcessGroup, world_group
from ngdist.errors import CheckpointError, InputError, NgdistError
from ngdist.ir.domain import DOMAIN, GRAD_SCALE
from ngdist.ir.writeback import WriteBack
from ngdist.ir.model import (assemble_training_model, debias_map, get_meta, save_proto,
                             split_training_model)
from ngdist.runtime import checkpoint, ps_server
from ngdist.runtime.executor import Executor, StepTimes
from ngdist.runtime.batch_checks import (check_label_values, check_same_size, infer_classes,
                                         label_checks, leaf_sizes, np_type, shape_str)
from ngdist.runtime.metrics import DEFAULT_EVERY, Evaluation, MetricsLog, eval_loss, loss_terms
from ngdist.runtime.microbatch import MicroBatchExecutor, micro_batch_size
from ngdist.runtime.sessions import Placement, make_session, placement_for
from ngdist.runtime.timeline import Timeline, check_path, timeline_path

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one step reports. ``loss`` is this rank's loss on its own shard."""

    loss: float
    step_time: float
    compute_time: float
    comm_time: float
    wait_time: float
    samples: int
    bytes_sent: int

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_time if self.step_time > 0 else float("nan")


def _default_threads(group: ProcessGroup) -> int:
    """The cores of this host per rank of the job on it."""
    return max(1, (os.cpu_count() or 1) // max(1, group.local_size))


class Trainer:
    """Trains a rewritten training model on this rank; every rank runs the same program."""

    def __init__(self, model: onnx.ModelProto, *, step: ir.Model | None = None,
                 group: ProcessGroup | None = None, timeout: float | None = None,
                 intra_op_threads: int | None = None, device: str | Placement = "cpu",
                 overlap: bool | None = None, devices_per_worker: int = 1,
                 ps_serve: bool = True, write_back: WriteBack | None = None,
                 nan_check: bool = True, timeline: str | os.PathLike | bool | None = None,
                 checkpoint_every: int | None = None,
                 checkpoint_dir: str | os.PathLike | None = None,
                 checkpoint_keep: int = checkpoint.DEFAULT_KEEP,
                 log_dir: str | os.PathLike | None = None,
                 log_every: int = DEFAULT_EVERY) -> None:
        """``timeline``: write a Chrome trace of the job to this file (default
        ``NGDIST_TIMELINE``; ``False``: off); see runtime/timeline.py. ``checkpoint_*``: see
        runtime/checkpoint.py; ``log_dir``, ``log_every``: runtime/metrics.py."""
        self.group = group or world_group(timeout)
        self.timeline: Timeline | None = None
        trace = timeline_path(timeline)
        if trace is not None and self.group.rank == 0:  # refused before anything runs
            check_path(trace)
        self.nan_check = nan_check  # a fetched loss that is NaN/Inf stops training
        self._uneven_logged = False
        self._write_back = write_back  # frontends: how to_torch / to_keras write values back
        self.placement = device if isinstance(device, Placement) else \
            placement_for(device, self.group.local_rank)
        if step is None:
            inference, step = split_training_model(model)
        else:
            inference = model
        self.inference = inference
        self.step_model = step
        self.meta = get_meta(step)
        self.debias = debias_map(step)  # pushsum: parameter -> push-sum weight (z = x / w)
        proto = ir.to_proto(step)
        threads = intra_op_threads or _default_threads(self.group)
        if overlap is None:  # a comm thread waiting on MPI spins: only beside a spare core
            overlap = _default_threads(self.group) > 1
        self.micro_batch = micro_batch_size(proto)  # > 0: reproducible mode
        if self.micro_batch:  # the tower once per micro-batch (runtime/microbatch.py)
            self.executor = MicroBatchExecutor(
                proto, self.group, self.micro_batch, data_inputs=self.meta.names("data"),
                sessions=devices_per_worker if devices_per_worker > 1 else threads,
                loss=self.meta.loss, params=self.meta.names("param"),
                placement=self.placement, overlap=overlap)
        elif devices_per_worker > 1:  # several model replicas in this process (runtime/replicas.py)
            from ngdist.runtime.replicas import ReplicatedExecutor
            self.executor = ReplicatedExecutor(
                proto, self.group, devices_per_worker, data_inputs=self.meta.names("data"),
                loss=self.meta.loss, params=self.meta.names("param"),
                placement=self.placement, intra_op_threads=threads, overlap=overlap)
        else:
            self.executor = Executor(proto, self.group, placement=self.placement,
                                     intra_op_threads=threads, overlap=overlap)
        graph = proto.graph
        self.data_inputs = {i.name: i for i in graph.input if self.meta.roles.get(i.name) == "data"}
        model_inputs = {i.name for i in inference.graph.input}
        # the model's own inputs (not labels), named when a batch size is baked into the model
        self._model_inputs = [n for n in self.data_inputs if n in model_inputs] or \
            list(self.data_inputs)
        self._label_checks = label_checks(graph, self.data_inputs, inference)
        self._classes_by_shape: dict[tuple, dict[str, int | None]] = {}
        self.steps_done = 0
        # inference sessions with the values of step ``[0]``, by the extra output they have
        self._sessions: tuple[int, dict[str | None, ort.InferenceSession]] = (-1, {})
        self._state_synced_at = 0  # steps_done when the ps owners' state was last gathered
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.checkpoint_keep = checkpoint_keep
        if self.checkpoint_dir is not None:
            self._check_checkpointable(graph)
        # every rank: same graph (structure and constants), then rank 0's values, broadcast
        # in host memory before they are placed
        self.group.check_same(self._graph_fingerprint(proto), "step graph")
        self.group.check_same(str(trace).encode(), f"timeline setting ({trace or 'off'})")
        if trace is not None:  # before a dedicated ps server starts serving
            self._attach_timeline(Timeline(trace, self.group))
        inits = {t.name: t for t in graph.initializer}
        host = {name: numpy_helper.to_array(inits[name]).copy()
                for name, role in self.meta.roles.items() if role != "data"}
        self.resumed_from = 0  # the step the newest checkpoint of checkpoint_dir ended
        if self.checkpoint_dir is not None:
            self.resumed_from = self.steps_done = self._resume(host)
        self.group.broadcast_arrays(list(host.values()))
        self.values: dict[str, ort.OrtValue] = {n: self.placement.value(a) for n, a in host.items()}
        # the training ranks' own group for metrics and evaluation: made here (collective)
        # when it is needed or a dedicated server rank is about to go off serving, else on
        # the first evaluate()
        workers = ps_server.planned_workers(self)
        self._stats_group: ProcessGroup | None = None
        self._stats_made = False
        if log_dir is not None or workers < self.group.size:
            self._stats_group = self.group.split(0 if self.rank < workers else None, self.rank,
                                                 "metrics and evaluation")
            self._stats_made = True
        self.epoch: int | None = None  # what the metrics rows say (set_epoch)
        restarted = self.resumed_from > 0 or os.environ.get("NGDIST_RESTART_COUNT", "0") != "0"
        self.metrics = MetricsLog(log_dir, self._stats_group, log_every, resume=restarted) \
            if log_dir is not None and self._stats_group is not None else None
        # ps: shard owners (collective); on a dedicated server rank with ps_serve, this
        # serves the workers until they stop (runtime/ps_server.py)
        self.ps = ps_server.attach(self, ps_serve)
        self.role = self.ps.role if self.ps else "worker"
        self.num_workers = self.ps.workers if self.ps else self.group.size  # ranks that train
        if GRAD_SCALE in self.values:  # gradients prescaled so that their sum is the mean
            self.values[GRAD_SCALE] = self.placement.value(
                np.array(1.0 / self.num_workers, self.values[GRAD_SCALE].numpy().dtype))
        logger.info("trainer ready: rank %d/%d, backend %s, %d segments, %d comm nodes",
                    self.group.rank, self.group.size, self.group.backend,
                    sum(1 for i in self.executor.items if hasattr(i, "nodes")),
                    len(self.executor.comm_nodes))

    # ------------------------------------------------------------------ checkpoints
    def _check_checkpointable(self, graph: onnx.GraphProto) -> None:
        """Checkpoints are written by rank 0 alone: only where every rank holds the same
        state (allreduce, simple; any strategy on one rank)."""
        comm = {n.op_type for n in graph.node if n.domain == DOMAIN}
        why = None
        if "PushSum" in comm:
            why = "under pushsum every rank holds its own parameters and push-sum weights"
        elif "PSPushPull" in comm:
            why = "under ps the optimizer state lives with the shard owners"
        elif not comm and self.group.size > 1:
            why = "without communication (strategy local) every rank trains its own model"
        if why:
            raise CheckpointError(
                f"checkpoint_dir: {why}, and a checkpoint holds one copy of the state written "
                "by rank 0; use the allreduce or simple strategy, or save per rank yourself "
                "(trainer.save(path, all_ranks=True); under ps trainer.sync_state() first)")

    def _resume(self, host: dict[str, np.ndarray]) -> int:
        """Collective: rank 0 loads the newest complete checkpoint of ``checkpoint_dir`` into
        ``host`` (which the caller broadcasts); every rank gets its step count, or the same
        CheckpointError."""
        assert self.checkpoint_dir is not None
        status, steps, message = 0, 0, b""
        if self.rank == 0:
            try:
                checkpoint.clean(self.checkpoint_dir)
                ckpt = checkpoint.latest(self.checkpoint_dir)
                if ckpt is not None:
                    checkpoint.check_model(ckpt, {n: a for n, a in host.items()
                                                  if n != GRAD_SCALE})
                    for name, arr in ckpt.values.items():
                        host[name][...] = arr.reshape(host[name].shape)
                    status, steps = 1, ckpt.steps_done
                    if ckpt.micro_batch != self.micro_batch:
                        logger.warning(
                            "%s was written with reproducible_micro_batch=%d, this trainer "
                            "runs with %d: training goes on, but not bit-for-bit as without "
                            "the interruption", ckpt.path, ckpt.micro_batch, self.micro_batch)
                    logger.info("resuming from %s (step %d, written by %d rank(s)) on %d "
                                "rank(s)", ckpt.path, steps, ckpt.ranks, self.group.size)
            except CheckpointError as exc:
                status, message = 2, str(exc).encode()
        header = np.array([status, steps, len(message)], np.int64)
        if self.group.size > 1:
            self.group.broadcast(header, 0, "checkpoint resume").wait()
            if header[0] == 2:
                text = np.frombuffer(message.ljust(int(header[2]), b"\0"), np.uint8).copy()
                self.group.broadcast(text, 0, "checkpoint resume").wait()
                message = text.tobytes()
        if header[0] == 2:
            raise CheckpointError(message.decode(errors="replace"))
        return int(header[1])

    def checkpoint(self) -> Path | None:
        """Collective: rank 0 writes a checkpoint of the current state to ``checkpoint_dir``
        while the others wait on a barrier; the file's path on rank 0, else None. ``step()``
        calls it every ``checkpoint_every`` steps."""
        if self.checkpoint_dir is None:
            raise NgdistError("this trainer has no checkpoint folder: pass checkpoint_dir= to "
                              "ngdist.compile or set NGDIST_CHECKPOINT_DIR")
        path = None
        if self.rank == 0:
            path = checkpoint.write(self.checkpoint_dir, self.state_dict(), self.steps_done,
                                    ranks=self.num_workers, micro_batch=self.micro_batch,
                                    keep=self.checkpoint_keep)
        if self.group.size > 1:
            self.group.barrier(f"checkpoint of step {self.steps_done}").wait()
        return path

    # ------------------------------------------------------------------ identity
    @property
    def stats_group(self) -> ProcessGroup | None:
        """The training ranks, with messages of their own (metrics, evaluation); None on a
        dedicated parameter-server rank. Collective on first use when not made at start."""
        if not self._stats_made:  # no dedicated servers: every rank is a training rank
            self._stats_group = self.group.dup("metrics and evaluation")
            self._stats_made = True
        return self._stats_group

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    def _graph_fingerprint(self, proto: onnx.ModelProto) -> bytes:
        g = copy.deepcopy(proto.graph)
        for t in g.initializer:
            if self.meta.roles.get(t.name, "data") != "data":
                t.ClearField("raw_data")
                for f in ("float_data", "int64_data", "int32_data", "double_data"):
                    t.ClearField(f)
        return g.SerializeToString(deterministic=True)

    def _attach_timeline(self, timeline: Timeline | None) -> None:
        """Where the executor, its inner executor (replicas) and the group record spans."""
        self.timeline = timeline
        self.group.timeline = timeline
        for executor in (self.executor, getattr(self.executor, "rest", None)):
            if executor is not None:
                executor.timeline = timeline

    def write_timeline(self) -> Path | None:
        """Collective (every rank): write the timeline recorded so far (rank 0 writes the one
        file of the job); the file's path, or None when the timeline is off. ``close()`` and
        the end of the program write it too."""
        return self.timeline.write() if self.timeline is not None else None

    # ------------------------------------------------------------------ data
    def shard(self, batches: Iterable[Any]) -> Iterator[Any]:
        """This rank's contiguous slice of every global batch (dict, tuple or array); nothing
        on a dedicated parameter-server rank."""
        if self.role == "server":
            return
        for batch in batches:
            t0 = time.perf_counter()
            self._check_global_batch(batch)
            mine = self._slice(batch)
            timeline = self.timeline
            if timeline is not None:
                timeline.record("feed", "shard batch", t0, time.perf_counter())
            yield mine

    def _check_global_batch(self, batch: Any) -> None:
        """Every array of a global batch holds the same number of samples, at least one per
        training rank; uneven shards are allowed and logged once."""
        sizes = leaf_sizes(batch)
        if not sizes:
            return
        check_same_size(sizes, "the global batch")
        n, w = next(iter(sizes.values())), self.num_workers
        m = self.micro_batch
        if m and n % m == 0:  # whole micro-batches to every rank
            if n // m < w:
                raise InputError(f"the global batch has {n // m} micro-batch(es) of {m} samples "
                                 f"for {w} training ranks, so some rank's shard would be empty: "
                                 f"the global batch must have at least as many micro-batches as "
                                 f"ranks ({w * m} samples or more)")
            uneven = (n // m) % w != 0
        else:
            if n < w:
                raise InputError(f"the global batch has {n} sample(s) for {w} training ranks, so "
                                 f"some rank's shard would be empty: the global batch must have "
                                 f"at least as many samples as ranks ({w})")
            uneven = n % w != 0
        if uneven and not self._uneven_logged:
            self._uneven_logged = True
            logger.info("the global batch of %d samples does not divide evenly over %d ranks: "
                        "shards differ by up to %d sample(s) (np.array_split), and the averaged "
                        "gradient weighs a sample of a smaller shard slightly more (logged once)",
                        n, w, m or 1)

    def _slice(self, batch: Any) -> Any:
        if isinstance(batch, Mapping):
            return {k: self._slice(v) for k, v in batch.items()}
        if isinstance(batch, (tuple, list)):
            return type(batch)(self._slice(v) for v in batch)
        arr = np.asarray(batch)
        m = self.micro_batch
        if m and arr.ndim and arr.shape[0] % m == 0:  # whole micro-batches to every rank
            k, w, r = arr.shape[0] // m, self.num_workers, self.rank
            return arr[m * (k * r // w):m * (k * (r + 1) // w)]
        if not arr.ndim:
            raise InputError(f"a global batch holds a scalar ({arr!r}); trainer.shard() splits "
                             "arrays along axis 0: give every input one row per sample")
        return np.array_split(arr, self.num_workers)[self.rank]

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
        check_same_size(sizes, "the batch")
        samples = next(iter(sizes.values()), 1)
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

    # ------------------------------------------------------------------ training
    def step(self, batch: Mapping[str, Any], fetch_stats: bool = True) -> StepStats | None:
        """One training step on this rank's batch. ``fetch_stats=False`` returns None without
        reading the loss back (nothing in a step waits on other ranks beyond its comm ops)."""
        if self.role == "server":
            raise NgdistError(f"rank {self.rank} is a dedicated parameter server: it has served "
                              "the workers' steps and takes none itself; iterate over "
                              "trainer.shard(...) (empty here) or skip step() on server ranks")
        timeline = self.timeline
        start = time.perf_counter()
        feeds, samples = self._feeds(batch)
        feeds.update(self.values)
        times = StepTimes()
        sent0 = self.group.bytes_sent
        t0 = time.perf_counter()
        if timeline is not None:
            timeline.record("feed", "feed batch", start, t0, {"samples": samples})
        outputs = self.executor.run(feeds, times)
        for name, out in self.meta.binding.items():
            self.values[name] = outputs[out]
        self.steps_done += 1
        loss = float(outputs[self.meta.loss].numpy()) if fetch_stats else math.nan
        if timeline is not None:
            self._record_step(start, samples, sent0, loss if fetch_stats else None)
        if fetch_stats and self.nan_check and not math.isfinite(loss):
            raise NgdistError(
                f"the loss is {loss} at step {self.steps_done} (rank {self.rank}); the "
                "parameters of this step are not usable: check the batch for NaN/Inf values "
                "and lower the learning rate, or pass nan_check=False to ngdist.compile to "
                "train on regardless")
        if self.checkpoint_every and self.steps_done % self.checkpoint_every == 0:
            self.checkpoint()  # after the NaN check: a diverged step is never checkpointed
        if not fetch_stats:
            return None
        stats = StepStats(loss, time.perf_counter() - t0, times.compute, times.comm, times.wait,
                          samples, self.group.bytes_sent - sent0)
        if self.metrics is not None:
            self.metrics.record(self.steps_done, self.epoch, stats)
        return stats

    def set_epoch(self, epoch: int | None) -> None:
        """The epoch that the metrics rows logged from now on carry (``log_dir``)."""
        self.epoch = epoch

    def evaluate(self, data: Mapping[str, Any], batch_size: int = 1024) -> Evaluation:
        """Validation loss and accuracy of the current parameters on ``data`` (the whole
        set, the same on every rank: input arrays and the labels). Collective over the training
        ranks: each evaluates its ``np.array_split`` shard with the inference graph, and the
        sums of per-sample losses and of correct predictions over the ranks are divided by the
        total count, so the result is the whole set's (on every rank). The loss is the
        training loss's formula (softmax_cross_entropy: mean over the samples that are not
        ``ignore_index``; mse: mean over all elements); accuracy (arg-max over axis 1 equal
        to the label) only for softmax_cross_entropy. With ``log_dir`` the result is logged
        as a ``val`` row. A dedicated parameter-server rank evaluates the whole set alone."""
        kind, scores, labels, ignore = eval_loss(self.step_model, self.meta.loss,
                                                  self.data_inputs, self._label_checks)
        needed = [*self._model_inputs, labels]
        missing = [n for n in needed if n not in data]
        if missing:
            raise InputError(f"evaluate() needs arrays {needed}; {missing} missing")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise InputError(f"evaluate(batch_size={batch_size!r}): give a whole number of "
                             "samples, at least 1")
        sizes = leaf_sizes({n: data[n] for n in needed})
        check_same_size(sizes, "the validation data")
        group = self.stats_group
        shard = {n: np.asarray(data[n]) if group is None else
                 np.array_split(np.asarray(data[n]), group.size)[group.rank] for n in needed}
        sess = self._inference_session(scores)
        totals = np.zeros(3, np.float64)  # loss sum, correct, counted (samples or elements)
        count = next(iter(sizes.values()), 0)
        local = len(shard[labels])
        for i in range(0, local, batch_size):
            feeds = {n: np.ascontiguousarray(shard[n][i:i + batch_size], dtype=np_type(
                self.data_inputs[n])) for n in self._model_inputs}
            logits = np.asarray(sess.run([scores], feeds)[0], np.float64)
            y = shard[labels][i:i + batch_size]
            if kind == "softmax_cross_entropy":  # class ids in range, as a step checks them
                check_label_values(labels, y, None, scores, ignore, None)
                check_label_values(labels, y, y.astype(np.int64), scores, ignore,
                                    logits.shape[1])
            totals += loss_terms(kind, logits, y, ignore)
        if group is not None and group.size > 1:
            group.allreduce(totals, "evaluate(): loss and correct counts").wait()
        loss_sum, correct, counted = totals
        loss_sum, correct, counted = float(loss_sum), float(correct), float(counted)
        result = Evaluation(loss=loss_sum / counted if counted else float("nan"),
                            accuracy=(correct / counted if counted else float("nan"))
                            if kind == "softmax_cross_entropy" else None, samples=count)
        if self.metrics is not None:
            self.metrics.validation(self.steps_done, self.epoch, result)
        return result

    def _inference_session(self, output: str | None = None) -> ort.InferenceSession:
        """A session of the inference graph with the current values; ``output`` (a value of
        the step graph, e.g. the scores of the loss) is added as an output if the model does
        not have it."""
        if self._sessions[0] != self.steps_done:
            self._sessions = (self.steps_done, {})
        sessions = self._sessions[1]
        if output in {o.name for o in self.inference.graph.output}:
            output = None  # the model's own session has it
        if output not in sessions:
            model = self.inference_model()
            if output is not None:
                dtype = next((o.dtype for n in self.step_model.graph for o in n.outputs
                              if o.name == output and o.dtype is not None), None)
                model.graph.output.append(onnx.helper.make_tensor_value_info(
                    output, int(dtype) if dtype is not None else onnx.TensorProto.FLOAT, None))
            sessions[output] = make_session(model, self.placement)
        return sessions[output]

    def _record_step(self, start: float, samples: int, sent0: int, loss: float | None) -> None:
        args = {"step": self.steps_done, "samples": samples,
                "bytes_sent": self.group.bytes_sent - sent0}
        if loss is not None:
            args["loss"] = loss
        self.timeline.record("step", f"step {self.steps_done}", start, time.perf_counter(), args)

    def set_lr(self, lr: float) -> None:
        if "ngdist.lr" not in self.values:
            raise KeyError("this model has no ngdist.lr hyper-parameter")
        self.values["ngdist.lr"] = self.placement.value(np.array(lr, np.float32))

    # ------------------------------------------------------------------ access
    def parameters(self) -> dict[str, np.ndarray]:
        """Copies of the trainable parameters (de-biased under pushsum), by initializer name."""
        values = self._deployable()
        return {n: np.array(values[n]) for n in self.meta.names("param")}

    def _deployable(self) -> dict[str, np.ndarray]:
        """Current values with pushsum's numerators replaced by z = x / w (and w by 1)."""
        values = {n: v.numpy() for n, v in self.values.items()}
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
        number of ranks."""
        return {n: v.numpy().copy() for n, v in self.values.items() if n != GRAD_SCALE}

    def load_state_dict(self, state: Mapping[str, np.ndarray]) -> None:
        state = {n: v for n, v in state.items() if n != GRAD_SCALE}  # a fact of this job
        unknown = set(state) - set(self.values)
        if unknown:
            raise KeyError(f"unknown names in state: {sorted(unknown)}")
        for n, v in state.items():
            self.values[n] = self.placement.value(
                np.array(v, dtype=self.values[n].numpy().dtype))

    def to_onnx(self) -> onnx.ModelProto:
        """The training model with the current values: deployable graph + training_info."""
        return assemble_training_model(self.inference, self.step_model, self._deployable())

    def inference_model(self) -> onnx.ModelProto:
        model = copy.deepcopy(self.inference)
        values = self._deployable()
        for t in model.graph.initializer:
            if t.name in values:
                t.CopyFrom(numpy_helper.from_array(values[t.name], t.name))
        return model

    def predict(self, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        """Runs the inference graph with the current parameters."""
        return self._inference_session().run(None, dict(inputs))

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
        optimizer state."""
        if self.rank == 0 or all_ranks:
            if self.steps_done != self._state_synced_at and self.role == "worker":
                if ps_server.runtime(self) is not None:
                    logger.warning(
                        "ps: %s gets the parameters of step %d but the optimizer state of step "
                        "%d (it lives with the shard owners); call trainer.sync_state() on "
                        "every worker before save() to include it", path, self.steps_done,
                        self._state_synced_at)
            save_proto(self.to_onnx(), path)

    def to_torch(self, module: Any = None, **kwargs: Any) -> Any:
        """Writes the trained parameters and buffers into the torch module this trainer was
        compiled from (or ``module``), and the optimizer state into a torch optimizer
        (``optimizer=``, by default the one compiled with). Returns the module."""
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

    def close(self) -> None:
        """Collective: ends training on this rank: the last metrics rows and the PNG (with
        ``log_dir``), the parameter servers, the comm thread, and the timeline."""
        if self.metrics is not None:
            self.metrics.close()
        if self.ps is not None:
            self.ps.close()
        self.executor.close()
        if self.timeline is not None:
            self.timeline.close()
            self._attach_timeline(None)
