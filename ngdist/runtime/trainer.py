"""The Trainer: holds parameters and optimizer state as OrtValues and runs training steps.

Here: start-up (executor, broadcast of rank 0's values, resuming from ``checkpoint_dir``),
the step, periodic checkpoints, the timeline and close(). The step's
feeds are checked and placed by runtime/feeds.py; global batches are cut into the ranks'
shards by runtime/global_batches.py; evaluate(), predict() and the inference model
come from runtime/inference.py; reading, loading, saving and writing back the state from
runtime/state.py; the checkpoint files and the collective resume live in runtime/checkpoint.py.
"""
from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
from onnx import numpy_helper

from ngdist.comm import ProcessGroup, exits, world_group
from ngdist.errors import NgdistError
from ngdist.ir.domain import GRAD_NORM, GRAD_SCALE
from ngdist.ir.writeback import WriteBack
from ngdist.ir.copies import to_proto_without_data
from ngdist.ir.model import debias_map, get_meta, split_training_model
from ngdist.runtime import accumulate, checkpoint, ps_server
from ngdist.runtime.executor import StepTimes
from ngdist.runtime.step_executor import StepExecutor, make_executor
from ngdist.runtime.batch_checks import label_checks
from ngdist.runtime.feeds import BatchFeeds
from ngdist.runtime.global_batches import GlobalBatches
from ngdist.runtime.hyper import Hypers
from ngdist.runtime.inference import Inference
from ngdist.runtime.join import Join, lockstep
from ngdist.runtime.metrics import DEFAULT_EVERY, MetricsLog
from ngdist.runtime.microbatch import micro_batch_size
from ngdist.comm.nccl import device_group
from ngdist.runtime.cuda import CudaOptions
from ngdist.runtime.sessions import Placement, placement_for
from ngdist.runtime.state import StateAccess
from ngdist.runtime.timeline import Timeline, check_path, timeline_path

logger = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one step reports. ``loss`` is this rank's loss on its own shard (for a mean over
    counted tokens, its term of the global batch's loss times the ranks: passes/losscount.py)."""

    loss: float
    step_time: float
    compute_time: float
    comm_time: float
    wait_time: float
    samples: int
    bytes_sent: int
    lr: float | None = None  # the step's learning rate (of group 0, the first group)
    grad_norm: float | None = None  # with clip_grad_norm: the gradients' norm before clipping

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.step_time if self.step_time > 0 else float("nan")


def _host_copy(tensor: ir.TensorProtocol) -> np.ndarray:
    """A writable array of ``tensor``'s value, read as from its proto (``numpy_helper``)."""
    raw = getattr(tensor, "raw", None)
    if isinstance(raw, onnx.TensorProto):
        return numpy_helper.to_array(raw).copy()
    return numpy_helper.to_array(ir.serde.serialize_tensor(tensor)).copy()


def _default_threads(group: ProcessGroup) -> int:
    """The cores of this host per rank of the job on it."""
    return max(1, (os.cpu_count() or 1) // max(1, group.local_size))


class Trainer(BatchFeeds, GlobalBatches, Inference, StateAccess, Hypers):
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
                 log_every: int = DEFAULT_EVERY, cuda: CudaOptions | None = None) -> None:
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
        self._start_placement(device, cuda)
        inference, step = split_training_model(model) if step is None else (model, step)
        self.inference, self.step_model = inference, step
        self.meta = get_meta(step)
        self.debias = debias_map(step)  # pushsum: parameter -> push-sum weight (z = x / w)
        # what the plan keeps alive holds no value's data (nor is a whole copy made first)
        proto = self._without_values(step)
        threads = intra_op_threads or _default_threads(self.group)
        if overlap is None:  # a comm thread waiting on MPI spins: only beside a spare core
            overlap = _default_threads(self.group) > 1
        self.micro_batch = micro_batch_size(proto)  # > 0: reproducible mode
        self.executor: StepExecutor = make_executor(
            proto, self.group, self.meta, self.placement, devices_per_worker=devices_per_worker,
            threads=threads, overlap=overlap)
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
        self.checkpoint_every, self.checkpoint_keep = checkpoint_every, checkpoint_keep
        self._start_state(step, proto, trace)
        self._start_metrics(log_dir, log_every)
        self._start_ps(ps_serve)
        self._accumulation = accumulate.attach(self, step, threads, StepStats)  # accumulate=k
        self._drop_template_data(set(self.values))  # runtime/state.py
        logger.info("trainer ready: rank %d/%d (%s), backend %s, %d segments, %d comm nodes",
                    self.group.rank, self.group.size, self.role, self.group.backend,
                    self.executor.segment_count, len(self.executor.comm_nodes))
        self.rank_role.start()  # a dedicated parameter server serves until the workers stop

    def _start_placement(self, device: str | Placement, cuda: CudaOptions | None) -> None:
        """Where values live; on a device, the group for device buffers (NCCL, or the host
        group with staged copies: comm/nccl.py). A group made here is the trainer's own:
        ``close()`` closes it."""
        self.placement = device if isinstance(device, Placement) else \
            placement_for(device, self.group.local_rank, cuda)
        self._own_group: ProcessGroup | None = None
        if self.placement.device == "cuda":
            opts = self.placement.cuda
            made = device_group(self.group, opts.comm, self.placement.device_id,
                                opts.user_compute_stream if opts.overlap_streams else None)
            self._own_group = made if made is not self.group else None
            self.group = made

    def _start_state(self, step: ir.Model, proto: onnx.ModelProto,
                     trace: Path | None) -> None:
        """Collective: every rank holds the same graph (structure and constants: ``proto``,
        ``step`` without the values' data) and timeline setting, then rank 0's values (or the
        newest checkpoint's, else ``step``'s), broadcast in host memory before they are
        placed."""
        if self.checkpoint_dir is not None:
            checkpoint.check_checkpointable(proto.graph, self.group.size)
        self.group.check_same(proto.graph.SerializeToString(deterministic=True), "step graph")
        self.group.check_same(str(trace).encode(), f"timeline setting ({trace or 'off'})")
        if trace is not None:  # before a dedicated ps server starts serving
            self._attach_timeline(Timeline(trace, self.group))
        inits = step.graph.initializers
        host = {name: _host_copy(inits[name].const_value)  # type: ignore[arg-type]
                for name, role in self.meta.roles.items() if role != "data"}
        self.resumed_from = 0  # the step the newest checkpoint of checkpoint_dir ended
        if self.checkpoint_dir is not None:
            self.resumed_from = self.steps_done = checkpoint.resume(
                self.checkpoint_dir, host, self.group, self.micro_batch)
        self.group.broadcast_arrays(list(host.values()))
        self.values: dict[str, ort.OrtValue] = {n: self.placement.value(a) for n, a in host.items()}

    def _start_metrics(self, log_dir: str | os.PathLike | None, log_every: int) -> None:
        """The training ranks' own group for metrics and evaluation: made here (collective)
        when it is needed or a dedicated server rank is about to go off serving, else on the
        first evaluate(); the metrics log with ``log_dir``."""
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

    def _start_ps(self, ps_serve: bool) -> None:
        """This rank's role (runtime/ps_server.py): with ps, shard owners (collective), and on
        a dedicated server rank the server, which serves once the trainer is ready."""
        self.rank_role: ps_server.Role = ps_server.attach(self, ps_serve)
        self.role = self.rank_role.name  # "worker", or "server": takes no steps
        self.num_workers = self.rank_role.workers  # ranks that train
        if GRAD_SCALE in self.values:  # gradients prescaled so that their sum is the mean
            self.values[GRAD_SCALE] = self.placement.value(
                np.array(1.0 / self.num_workers, self.values[GRAD_SCALE].numpy().dtype))

    # ------------------------------------------------------------------ checkpoints
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

    def _without_values(self, step: ir.Model) -> onnx.ModelProto:
        """``step`` as a proto with the data of the values (parameters, optimizer state,
        hypers: step inputs the trainer feeds) left out, never serialised. The executor's
        plan keeps its nodes and constants, which would keep a whole proto alive; ranks
        compare its graph's bytes."""
        return to_proto_without_data(step, lambda n: self.meta.roles.get(n, "data") != "data")

    def _attach_timeline(self, timeline: Timeline | None) -> None:
        """Where the executor and the group record spans."""
        self.timeline = timeline
        self.group.timeline = timeline
        self.executor.set_timeline(timeline)

    def write_timeline(self) -> Path | None:
        """Collective (every rank): write the timeline recorded so far (rank 0 writes the one
        file of the job); the file's path, or None when the timeline is off. ``close()`` and
        the end of the program write it too."""
        return self.timeline.write() if self.timeline is not None else None

    # ------------------------------------------------------------------ training
    def step(self, batch: Mapping[str, Any], fetch_stats: bool = True,
             sync: bool | None = None) -> StepStats | None:
        """One training step on this rank's batch. ``fetch_stats=False`` returns None without
        reading the loss back (nothing in a step waits on other ranks beyond its comm ops).
        With ``accumulate=k`` a step is a micro-step and every k-th one updates; ``sync=False``
        / ``True`` makes it a micro-step / an update (runtime/accumulate.py)."""
        self.rank_role.refuse_step()  # a dedicated parameter server takes none
        if self._accumulation is None:
            accumulate.refuse_sync(sync)
        elif self._accumulation.inner(sync):
            return self._accumulation.micro_step(batch, fetch_stats)
        else:
            self._accumulation.before_update()
        self._follow_hypers()  # a torch optimizer's current learning rates (runtime/hyper.py)
        timeline = self.timeline
        start = time.perf_counter()
        feeds, samples = self._feeds(batch)
        if self._joining is not None:  # uneven inputs (runtime/join.py): count, scale
            self._joining.before_step(feeds)
        feeds.update(self.values)
        times = StepTimes()
        sent0 = self.group.bytes_sent
        t0 = time.perf_counter()
        if timeline is not None:
            timeline.record("feed", "feed batch", start, t0, {"samples": samples})
        self._note_step(self.steps_done + 1)
        outputs = self.executor.run(feeds, times)
        for name, out in self.meta.binding.items():
            self.values[name] = outputs[out]
        self.steps_done += 1
        self._note_step(0)
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
                          samples, self.group.bytes_sent - sent0, self._first_lr(),
                          float(outputs[GRAD_NORM].numpy()) if GRAD_NORM in outputs else None)
        if self.metrics is not None:
            self.metrics.record(self.steps_done, self.epoch, stats)
        return stats

    _joining: Join | None = None  # the open ``join()`` block
    _accumulation: accumulate.Accumulation | None = None  # accumulate=k
    _lockstep: bool | None = None  # every rank takes every step (known at the first step)

    def _note_step(self, step: int) -> None:
        """What a peer's failure names (comm/exits.py): the step this rank is in, 0 after."""
        if self.group.size > 1:
            if self._lockstep is None:
                self._lockstep = lockstep(self)
            exits.note_step(step, self.steps_done, self._lockstep)

    def join(self) -> Join:
        """``with trainer.join():`` around the loop over this rank's batches when the ranks
        have different numbers of them (DDP's ``Join``): a rank that runs out answers the
        others' steps with zero gradients until every rank has left the block, and the
        gradients are averaged over the ranks that contributed (runtime/join.py)."""
        return Join(self)

    def set_epoch(self, epoch: int | None) -> None:
        """The epoch that the metrics rows logged from now on carry (``log_dir``)."""
        self.epoch = epoch

    def _record_step(self, start: float, samples: int, sent0: int, loss: float | None) -> None:
        args = {"step": self.steps_done, "samples": samples,
                "bytes_sent": self.group.bytes_sent - sent0}
        if loss is not None:
            args["loss"] = loss
        self.timeline.record("step", f"step {self.steps_done}", start, time.perf_counter(), args)

    def close(self) -> None:
        """Collective: ends training on this rank: the last metrics rows and the PNG (with
        ``log_dir``), the parameter servers, the comm thread, the timeline, and the device
        group the trainer made (an NcclGroup's communicator)."""
        if self.metrics is not None:
            self.metrics.close()
        self.rank_role.close()
        self.executor.close()
        if self._accumulation is not None:
            self._accumulation.close()
        if self.timeline is not None:
            self.timeline.close()
            self._attach_timeline(None)
        if self._own_group is not None:
            self._own_group.close()
