"""``ngdist.DistributedSGD``: Ray SGD's entry point, over ngdist's compiled training graphs.

Ray SGD (``ray.experimental.sgd.DistributedSGD``) drives ``num_workers`` actors from one
driver; ngdist runs the same program on every MPI rank (SPMD). So a Ray script moves over by
launching it with ``ngdist run -n N [--servers K] -- python train.py``, and:

* ``model_creator(worker_index, device_index)`` returns a ``Model``: an ONNX model (path or
  ModelProto), its loss and optimizer, and ``get_feed_dict()`` giving that replica's next
  batch (Ray's ``Model`` contract). Every rank calls it for its own replicas only; a dedicated
  server rank calls ``model_creator(0, 0)`` for the graph and never asks it for data.
* ``num_workers`` must equal the number of training ranks (``size - servers``);
  ``devices_per_worker`` replicas run in each (runtime/replicas.py);
* ``step()`` takes no batch (the models supply it), returns ``None`` unless ``fetch_stats``,
  then a ``StepStats`` whose ``loss`` is the mean over all workers (one small Allreduce
  among the workers: the only barrier it adds; none with ``micro_batch``, whose loss is
  already the global batch's);
* ``micro_batch=M`` (allreduce only) is reproducible mode (passes/reproducible.py): every
  replica's batch is cut into micro-batches of ``M`` samples whose gradients are summed
  exactly, so training is bit-for-bit the same for any ``num_workers`` and
  ``devices_per_worker`` that feed the same global batches, and a checkpoint restored on
  another number of workers continues exactly as the uninterrupted run;
* ``foreach_model`` / ``foreach_worker`` apply a function to *this rank's* replicas / worker
  and return this rank's results (there is no driver to collect them);
* ``save_checkpoint`` / ``restore_checkpoint`` are collective over the workers. The file is a
  standard ONNX training model (the model before the strategy's rewrite, with the current
  parameters, optimizer state, step count and learning rate), written atomically by rank 0;
  it can be restored under any strategy and any number of ranks, or opened by
  ``ngdist.compile``. Under ``ps`` the optimizer state is gathered from the shard owners.
* On a dedicated server rank (strategy ``ps``, the last ``servers`` ranks) the same calls
  serve the workers in lockstep: ``step()`` serves one step (and returns the stats of that
  round, with the workers' mean loss), ``save_checkpoint()`` sends the server's optimizer
  state, ``close()`` ends the session; no data is read there (runtime/ps_server.py).
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ngdist import api, optim
from ngdist.errors import CommError, NgdistError
from ngdist.ir.model import load_proto, save_proto
from ngdist.kernels.ps import STEP, resolve_servers
from ngdist.passes.options import refuse_unknown, strategy_options
from ngdist.runtime import ps_server
from ngdist.comm import world_rank_size
from ngdist.runtime.trainer import StepStats, Trainer

logger = logging.getLogger(__name__)

STRATEGIES = ("ps", "simple", "allreduce")
CHECKPOINT_NAME = "model.onnx"


class Model:
    """What ``model_creator`` returns: an ONNX model, how to train it (``optimizer`` is
    required, as for ``ngdist.compile``), and its data.

    ``data``: an iterator of feed dicts (``{"x": ..., "y": ...}``) or a callable returning the
    next one; or override ``get_feed_dict``. ``get_weights`` / ``set_weights`` read and write
    the trained parameters once the model belongs to a ``DistributedSGD``; ``set_weights`` is
    collective (call it on every worker with the same weights, as ``foreach_model`` does).
    """

    def __init__(self, model: onnx.ModelProto | str | os.PathLike, *,
                 loss: str | None = "softmax_cross_entropy", labels: str = "y",
                 optimizer: optim.Optimizer | str | None = None,
                 params: list[str] | None = None, frozen: list[str] | None = None,
                 output: str | None = None,
                 data: Iterator[Mapping[str, np.ndarray]] | Callable[[], Mapping] | None = None
                 ) -> None:
        self.model, self.loss, self.labels, self.optimizer = model, loss, labels, optimizer
        self.params, self.frozen, self.output, self.data = params, frozen, output, data
        self._sgd: DistributedSGD | None = None

    def get_feed_dict(self) -> Mapping[str, np.ndarray]:
        if self.data is None:
            raise NgdistError("this Model has no data: pass data= (an iterator or callable "
                              "of feed dicts) or override get_feed_dict()")
        try:
            return self.data() if callable(self.data) else next(self.data)
        except StopIteration:
            raise NgdistError("the Model's data iterator is exhausted") from None

    def _trainer(self) -> Trainer:
        if self._sgd is None:
            raise NgdistError("the model is not part of a DistributedSGD yet")
        return self._sgd.trainer

    def get_weights(self) -> dict[str, np.ndarray]:
        return self._trainer().parameters()

    def set_weights(self, weights: Mapping[str, np.ndarray]) -> None:
        trainer = self._trainer()
        trainer.load_state_dict(weights)
        ps_server.load_state(trainer, with_state=False)


@dataclass
class Worker:
    """This rank's worker, as ``foreach_worker`` sees it."""

    index: int
    trainer: Trainer
    models: list[Model] = field(default_factory=list)


class DistributedSGD:
    """Ray SGD's ``DistributedSGD`` on ngdist: ``strategy`` is ``ps`` (sharded parameter
    servers; ``servers`` dedicated ranks or co-located), ``simple`` (gradients averaged at
    rank 0) or ``allreduce`` (with ``all_reduce_alg``); ``grad_shard_bytes`` bounds a ps
    shard. ``gpu=True`` runs the replicas on onnxruntime's CUDA provider. ``micro_batch``:
    reproducible mode of ``allreduce`` (micro-batches of that many samples, exact sums).
    A strategy option left at None takes the strategy's default; one the strategy does not
    take (``all_reduce_alg`` with ``ps``) or an unknown keyword is an OptionError."""

    def __init__(self, model_creator: Callable[[int, int], Model], num_workers: int,
                 devices_per_worker: int = 1, gpu: bool = False, strategy: str = "ps",
                 grad_shard_bytes: int | None = None, all_reduce_alg: str | None = None, *,
                 servers: int | None = None, bucket_bytes: int | None = None,
                 timeout: float | None = None, intra_op_threads: int | None = None,
                 micro_batch: int | None = None, **unknown: Any) -> None:
        refuse_unknown(unknown, "ngdist.DistributedSGD", _PARAMETERS)
        if strategy not in STRATEGIES:
            raise NgdistError(f"DistributedSGD strategy must be one of {list(STRATEGIES)}, "
                              f"not {strategy!r}")
        if micro_batch and strategy != "allreduce":
            raise NgdistError(f"micro_batch (reproducible mode) needs strategy='allreduce', "
                              f"not {strategy!r}")
        # the strategy's options, as given (None: the strategy's default); one that the
        # strategy does not take is refused before any model is built
        options: dict[str, Any] = {k: v for k, v in (
            ("grad_shard_bytes", grad_shard_bytes), ("all_reduce_alg", all_reduce_alg),
            ("servers", servers), ("bucket_bytes", bucket_bytes),
            ("reproducible_micro_batch", micro_batch or None)) if v is not None}
        strategy_options(strategy, options)
        if devices_per_worker < 1:
            raise NgdistError(f"devices_per_worker must be >= 1, got {devices_per_worker}")
        rank, size = world_rank_size()
        k = resolve_servers(servers or 0, size) if strategy == "ps" else 0
        if size - k != num_workers:
            launch = f"ngdist run -n {num_workers + k}{f' --servers {k}' if k else ''}"
            raise NgdistError(f"DistributedSGD(num_workers={num_workers}) but this job has "
                              f"{size - k} worker rank(s) ({size} rank(s), {k} server(s)); "
                              f"launch it with `{launch} -- python SCRIPT`")
        self.strategy, self.num_workers, self.rank = strategy, num_workers, rank
        self.is_server = is_server = rank >= num_workers
        device = "cuda" if gpu else "cpu"
        self.models = [model_creator(0 if is_server else rank, d)
                       for d in range(1 if is_server else devices_per_worker)]
        bad = [type(m).__name__ for m in self.models if not isinstance(m, Model)]
        if bad:
            raise NgdistError(f"model_creator must return ngdist.compat.ray.Model objects, "
                              f"got {bad}")
        m0 = self.models[0]
        self.training_model = api.to_training_model(
            m0.model, loss=m0.loss, labels=m0.labels, optimizer=m0.optimizer, params=m0.params,
            frozen=m0.frozen, output=m0.output)
        self.trainer = api.compile(self.training_model, strategy=strategy, timeout=timeout,
                                   intra_op_threads=intra_op_threads, device=device,
                                   devices_per_worker=devices_per_worker, ps_serve=False,
                                   **options)
        # loss mean, barrier, restore broadcast: messages of their own
        self._group = self.trainer.group.dup("DistributedSGD set-up")
        for m in self.models:
            m._sgd = self
        self.worker = Worker(rank, self.trainer, self.models)

    # ------------------------------------------------------------------ training
    def step(self, fetch_stats: bool = False) -> StepStats | None:
        """One synchronous SGD step on every worker, each replica on its model's next batch
        (on a dedicated server rank: serve that step)."""
        if self.is_server:
            sent0, t0 = self.trainer.group.bytes_sent, time.perf_counter()
            ps_server.serve_round(self.trainer, expect=STEP)
            dt = time.perf_counter() - t0
            stats = StepStats(0.0, dt, 0.0, dt, 0.0, 0, self.trainer.group.bytes_sent - sent0)
        else:
            feeds = [m.get_feed_dict() for m in self.models]
            batch = feeds[0] if len(feeds) == 1 else \
                {k: np.concatenate([np.asarray(f[k]) for f in feeds]) for k in feeds[0]}
            stats = self.trainer.step(batch, fetch_stats=fetch_stats)
        if not fetch_stats:
            return None
        if self.trainer.micro_batch:  # reproducible mode: the loss is the global batch's
            return stats
        loss = np.array([stats.loss], np.float64)  # a server adds 0
        self._group.allreduce(loss, "the mean loss over the workers (fetch_stats)").wait()
        return dataclasses.replace(stats, loss=float(loss[0]) / self.num_workers)

    def foreach_model(self, fn: Callable[[Model], Any]) -> list[Any]:
        """``fn`` applied to each replica of this rank (its results, in device order)."""
        return [fn(m) for m in self.models]

    def foreach_worker(self, fn: Callable[[Worker], Any]) -> list[Any]:
        """``fn`` applied to this rank's worker (a one-element list, as each rank has one)."""
        return [fn(self.worker)]

    def for_model(self, fn: Callable[[Model], Any]) -> Any:
        return fn(self.models[0])

    # ------------------------------------------------------------------ checkpoints
    @staticmethod
    def _file(path: str | os.PathLike) -> Path:
        p = Path(path)
        return p if p.suffix == ".onnx" else p / CHECKPOINT_NAME

    def _barrier(self, what: str) -> None:
        self._group.barrier(what).wait()

    def save_checkpoint(self, path: str | os.PathLike) -> str:
        """Collective: parameters, optimizer state, step count and learning rate, as an ONNX
        training model at ``path`` (a directory gets ``model.onnx``). Returns the file."""
        file = self._file(path)
        values = self.trainer.state_dict()
        owned = ps_server.gather_state(self.trainer)  # ps: the owners' live optimizer state
        if self.rank == 0:
            values.update(owned or {})
            save_proto(_with_values(self.training_model, values), file)
        self._barrier(f"save_checkpoint({file})")
        return str(file)

    def restore_checkpoint(self, path: str | os.PathLike) -> None:
        """Collective: continue from a checkpoint (any strategy or rank count wrote it)."""
        file = self._file(path)
        wanted = self.trainer.state_dict()
        error = b""
        if self.rank == 0:
            try:
                values = _checkpoint_values(load_proto(file), wanted, file)
            except NgdistError as exc:
                error = str(exc).encode()
        else:
            values = {n: np.empty_like(v) for n, v in wanted.items()}
        self._broadcast_error(error)
        self.trainer.group.broadcast_arrays([values[n] for n in sorted(values)],
                                            what=f"restore_checkpoint({file})")
        self.trainer.load_state_dict(values)
        ps_server.load_state(self.trainer, with_state=True)

    def _broadcast(self, arr: np.ndarray, what: str) -> None:
        self._group.broadcast(arr, 0, what).wait()

    def _broadcast_error(self, error: bytes) -> None:
        """Rank 0's error (if any) raised on every worker, so that no rank waits forever."""
        size = np.array([len(error)], np.int64)
        self._broadcast(size, "restore_checkpoint")
        if not size[0]:
            return
        msg = np.frombuffer(error, np.uint8).copy() if self.rank == 0 else \
            np.empty(int(size[0]), np.uint8)
        self._broadcast(msg, "restore_checkpoint")
        text = msg.tobytes().decode()
        if self.rank == 0:
            raise NgdistError(text)
        raise CommError(f"rank 0 could not restore the checkpoint: {text}")

    def close(self) -> None:
        """Ends the session (collective; on a server rank, serves the workers' last round)."""
        self.trainer.close()


# the keywords DistributedSGD takes, for the "did you mean" of a misspelt one
_PARAMETERS = [p for p in inspect.signature(DistributedSGD.__init__).parameters
               if p not in ("self", "unknown")]


def _initializers(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    inits = list(model.graph.initializer)
    for info in model.training_info:
        inits += list(info.algorithm.initializer)
    return inits


def _with_values(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of the training model whose initializers hold ``values`` (by name)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for t in _initializers(out):
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(np.asarray(values[t.name]), t.name))
    return out


def _checkpoint_values(model: onnx.ModelProto, wanted: Mapping[str, np.ndarray],
                       file: Path) -> dict[str, np.ndarray]:
    have = {t.name: numpy_helper.to_array(t) for t in _initializers(model)}
    missing = sorted(set(wanted) - set(have))
    if missing:
        raise NgdistError(f"{file} is not a checkpoint of this model: it lacks {missing[:8]}")
    out = {}
    for name, like in wanted.items():
        arr = have[name]
        if arr.shape != like.shape or arr.dtype != like.dtype:
            raise NgdistError(f"{file} is not a checkpoint of this model: '{name}' is "
                              f"{arr.dtype}{list(arr.shape)} there, {like.dtype}"
                              f"{list(like.shape)} here")
        out[name] = np.array(arr)
    return out
