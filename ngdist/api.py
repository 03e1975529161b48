"""``ngdist.compile``: model in, distributed trainer out."""
from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import onnx

from ngdist import optim
from ngdist.errors import ArgumentTypeError, GraphError, OptionError, OutOfMemoryError
from ngdist.frontends.onnx import build_training_model
from ngdist.ir.model import check_training_model, load_proto, split_training_model
from ngdist.ir.modelfile import refuse_external_data
from ngdist.passes.options import TypedOptions, strategy_options as _strategy_options
from ngdist.passes.pipeline import run_passes
from ngdist.passes.step_options import StepOptions
from ngdist.comm import LocalGroup, world_group, world_rank_size
from ngdist.runtime import checkpoint
from ngdist.runtime.cuda import CudaOptions
from ngdist.runtime.metrics import DEFAULT_EVERY
from ngdist.runtime.sessions import out_of_memory
from ngdist.runtime.trainer import Trainer
from ngdist.ir.shards import file_layout
from ngdist.sharded import compile_sharded

logger = logging.getLogger(__name__)

_UNSET: Any = object()


def rank() -> int:
    """This process's rank (0 when not launched by mpiexec)."""
    return world_rank_size()[0]


def size() -> int:
    """The number of ranks (1 when not launched by mpiexec)."""
    return world_rank_size()[1]


def barrier(timeout: float | None = None) -> None:
    """Returns once every rank has called it (bounded by ``timeout``/NGDIST_TIMEOUT)."""
    world_group(timeout).barrier("ngdist.barrier()").wait()


def allreduce_mean(value: Any, timeout: float | None = None) -> Any:
    """The mean of ``value`` over every rank, the same on every rank (e.g. an evaluation metric).

    ``value``: a number (a float comes back) or a numpy array of real numbers (an array of the
    same shape comes back, in the array's dtype when it is a floating one, else float64). Every
    rank must call it with a value of the same shape. The sum is taken in float64 and rank 0's
    result goes to every rank, so all ranks get the same bits. On one rank the value comes back
    unchanged (a float, or a new array). Bounded by ``timeout``/NGDIST_TIMEOUT like ``barrier``.
    """
    import hashlib

    import numpy as np

    from ngdist.errors import CommError

    what = "ngdist.allreduce_mean()"
    if isinstance(value, np.ndarray):
        array = value
    elif isinstance(value, (int, float, np.integer, np.floating, np.bool_)):
        array = None
    else:
        raise ArgumentTypeError(f"{what} takes a number or a numpy array, not {type(value).__name__}")
    if array is not None and array.dtype.kind not in "biuf":
        raise ArgumentTypeError(f"{what} takes an array of real numbers, not of dtype {array.dtype}")
    dtype = array.dtype if array is not None and array.dtype.kind == "f" else np.dtype(np.float64)
    group = world_group(timeout)
    if group.size == 1:
        return float(value) if array is None else array.astype(dtype, copy=True)
    buf = np.array(value, dtype=np.float64).reshape(-1)  # a copy: the caller's value is left as is
    shape = () if array is None else array.shape
    digest = hashlib.sha256(repr(shape).encode()).digest()[:8]
    mine = np.frombuffer(digest, dtype=np.int64).copy()
    table = np.empty(group.size, np.int64)
    group.allgather(mine, table, f"{what} shape check").wait()
    differ = [r for r in range(group.size) if table[r] != table[0]]
    if differ:
        raise CommError(
            f"{what}: ranks {differ} passed a value of another shape than rank 0 (this is "
            f"rank {group.rank}, shape {shape}); every rank must pass the same shape")
    group.allreduce(buf, what).wait()
    group.broadcast(buf, 0, what).wait()
    buf /= group.size
    if array is None:
        return float(buf[0])
    return buf.reshape(array.shape).astype(dtype)


def to_training_model(model: onnx.ModelProto | str | os.PathLike, *, loss: Any = _UNSET,
                      labels: str = "y", optimizer: Any = _UNSET, params: list[str] | None = None,
                      frozen: list[str] | None = None, output: str | None = None
                      ) -> onnx.ModelProto:
    """A training model from a path or ModelProto: used as is if it already is one."""
    if isinstance(model, onnx.ModelProto):
        proto = model
        refuse_external_data(proto)  # its folder is unknown: nothing is read from a guess
        check_training_model(proto)
    else:
        proto = load_proto(model)
    if proto.training_info:
        if loss is not _UNSET or optimizer is not _UNSET or params or frozen:
            raise GraphError("the model is already a training model (it has training_info); "
                             "do not pass loss=, optimizer=, params= or frozen=")
        return proto
    if optimizer is _UNSET or optimizer is None:
        what = "the ONNX model" if isinstance(model, onnx.ModelProto) else os.fspath(model)
        raise optim.missing_optimizer(what)
    return build_training_model(
        proto, loss="softmax_cross_entropy" if loss is _UNSET else loss, labels=labels,
        optimizer=optimizer, params=params, frozen=frozen, output=output)


def _framework_frontend(model: Any) -> Any:
    """The frontend module for a torch.nn.Module or Keras model, None for ONNX input."""
    if isinstance(model, (onnx.ModelProto, str, os.PathLike)):
        return None
    from ngdist.frontends import keras as keras_frontend, torch as torch_frontend
    for frontend in (torch_frontend, keras_frontend):
        if frontend.is_module(model):
            return frontend
    return None


@dataclass(frozen=True)
class RuntimeOptions(TypedOptions):
    """How this process runs the compiled step, whatever the strategy (``ngdist.compile``).

    ``timeout``: seconds before a stuck collective fails (default NGDIST_TIMEOUT);
    ``intra_op_threads``: onnxruntime threads (default cores / ranks on this host);
    ``device``: ``cpu``, ``cuda`` or ``auto``; ``overlap``: communication runs on a thread of
    its own and overlaps computation (default: when the host has more than one core per rank;
    a thread waiting on MPI spins, and on a rank's only core it takes the compute's time:
    docs/benchmarks.md); with ``pushsum`` it is also the gossip's overlap, off by default there;
    ``devices_per_worker``: model replicas in this process (runtime/replicas.py);
    ``ps_serve``: with ``ps`` and dedicated servers, False makes a server rank serve round by
    round as its program calls ``step`` (``DistributedSGD``) instead of until the workers stop;
    ``nan_check``: a step that fetches its loss (``fetch_stats=True``) raises when the loss is
    NaN or infinite, naming the step (default True; it reads nothing more than the loss);
    ``timeline``: write a Chrome trace of the whole job (every rank's compute, comm, waits and
    steps) to this file, opened by Perfetto or chrome://tracing (default ``NGDIST_TIMELINE``;
    ``False``: off); rank 0 writes it at ``trainer.close()``, ``trainer.write_timeline()`` or
    the end of the program (runtime/timeline.py).
    ``checkpoint_every``, ``checkpoint_dir``, ``checkpoint_keep``: a checkpoint every N steps
    in the folder (default NGDIST_CHECKPOINT_EVERY, NGDIST_CHECKPOINT_DIR), keeping the newest
    ``checkpoint_keep`` (default ``checkpoint.DEFAULT_KEEP``); with a folder, the trainer
    resumes from its newest complete checkpoint (runtime/checkpoint.py).
    ``log_dir``: write training metrics there (``metrics.csv`` by rank 0, TensorBoard events
    and ``metrics.png`` with the ``metrics`` extra; runtime/metrics.py): every step that
    fetches its stats, with the loss averaged over the ranks, and every ``trainer.evaluate``;
    ``log_every``: steps recorded between two reductions of the metrics over the ranks (one
    small allreduce each, default 10).
    ``cuda``: the CUDA provider's options on ``device="cuda"`` (runtime/cuda.py
    ``CudaOptions``: ``use_tf32``, ``cudnn_conv_algo_search``, arena, ``user_compute_stream``).
    """

    owner: ClassVar[str] = "ngdist.compile"
    timeout: float | None = None
    intra_op_threads: int | None = None
    device: str = "cpu"
    overlap: bool | None = None
    devices_per_worker: int = 1
    ps_serve: bool = True
    nan_check: bool = True
    timeline: str | os.PathLike | bool | None = None
    checkpoint_every: int | None = None
    checkpoint_dir: str | None = None
    checkpoint_keep: int = checkpoint.DEFAULT_KEEP
    log_dir: str | os.PathLike | None = None
    log_every: int = DEFAULT_EVERY
    cuda: CudaOptions | None = None

    def as_kwargs(self) -> dict[str, Any]:
        """The options as the Trainer's keyword arguments (it takes each, by the same name)."""
        return {name: getattr(self, name) for name in self.names()}


def _checkpoint_options(every: int | None, folder: str | os.PathLike | None
                        ) -> tuple[int | None, str | None]:
    """``checkpoint_every`` and ``checkpoint_dir``, from NGDIST_CHECKPOINT_EVERY and
    NGDIST_CHECKPOINT_DIR where not given."""
    if folder is None:
        folder = os.environ.get("NGDIST_CHECKPOINT_DIR") or None
    if every is None and os.environ.get("NGDIST_CHECKPOINT_EVERY", "").strip():
        text = os.environ["NGDIST_CHECKPOINT_EVERY"]
        try:
            every = int(text)
        except ValueError:
            raise OptionError(f"NGDIST_CHECKPOINT_EVERY={text!r} is not a whole number of "
                              "steps; set it to e.g. 100") from None
    if every is not None and folder is None:
        raise OptionError(f"checkpoint_every={every} needs a folder: pass checkpoint_dir= or "
                          "set NGDIST_CHECKPOINT_DIR (ngdist run --checkpoint-dir DIR)")
    return every, (os.fspath(folder) if folder is not None else None)


def _named_out_of_memory(build: Any) -> Any:
    """``build``, whose refused allocations (a ``MemoryError`` from numpy, protobuf or Python
    while the model is loaded, rewritten or split) end as an OutOfMemoryError naming the limit
    in force and what to do, like those of a step."""
    @functools.wraps(build)
    def named(*args: Any, **kwargs: Any) -> Any:
        try:
            return build(*args, **kwargs)
        except OutOfMemoryError:
            raise
        except MemoryError as exc:
            raise (out_of_memory("ngdist.compile", exc) or exc) from exc
    return named


@_named_out_of_memory
def compile(model: onnx.ModelProto | str | os.PathLike | Any,  # noqa: A001
            example_inputs: Any = None, *, loss: Any = _UNSET, labels: str = "y",
            optimizer: Any = _UNSET, strategy: str = "allreduce",
            params: list[str] | None = None, frozen: list[str] | None = None,
            output: str | None = None, input_names: Sequence[str] | None = None,
            output_names: Sequence[str] | None = None, kvstore: Any = None,
            timeout: float | None = None, intra_op_threads: int | None = None,
            device: str = "cpu", overlap: bool | None = None, devices_per_worker: int = 1,
            ps_serve: bool = True, nan_check: bool = True,
            timeline: str | os.PathLike | bool | None = None,
            checkpoint_every: int | None = None,
            checkpoint_dir: str | os.PathLike | None = None,
            checkpoint_keep: int = checkpoint.DEFAULT_KEEP,
            log_dir: str | os.PathLike | None = None, log_every: int = DEFAULT_EVERY,
            cuda: CudaOptions | None = None, clip_grad_norm: float | None = None,
            clip_grad_value: float | None = None, accumulate: int = 1,
            **strategy_options: Any) -> Trainer:
    """Build (if needed) and rewrite a training model, and return a Trainer for this rank.

    ``model``: a forward-only ONNX model (path or ModelProto), trained with ``loss`` against
    the input named ``labels`` and updated by ``optimizer``; or a training model (from
    ``trainer.save`` or ``ngdist rewrite``), used as it is.
    A ``torch.nn.Module`` or Keras model (with ``example_inputs``; ``input_names``, and for
    torch ``output_names``, name the graph's values) goes through its frontend
    (ngdist.frontends.torch / .keras); ``trainer.to_torch()`` / ``to_keras()`` write the
    trained values back.
    ``kvstore``: a store from ``ngdist.kvstore.create``; its type picks the strategy
    (dist_sync/dist_allreduce: allreduce, pushsum: pushsum, local: local) and its ngdist
    optimizer is used when ``optimizer`` is not given.
    ``timeout`` ... ``log_every``: how this process runs the step and logs its metrics
    (:class:`RuntimeOptions`). ``checkpoint_every=N`` with ``checkpoint_dir=DIR`` (or
    NGDIST_CHECKPOINT_DIR): rank 0 writes a checkpoint every N steps; with a folder, the trainer
    starts from the newest complete checkpoint there and ``trainer.resumed_from`` says from
    which step (skip the batches before it).
    ``strategy_options``: the strategy's knobs (ngdist.passes.options): ``allreduce``:
    ``bucket_bytes``, ``all_reduce_alg``, ``reproducible_micro_batch``, ``compression``,
    ``compression_error_feedback``, ``shard`` ("optimizer": ZeRO-1, "gradients": ZeRO-2;
    passes/shard.py; ``trainer.save`` is then collective); ``pushsum``:
    ``graph``, ``peers_per_itr``, ``overlap``, ``synch_freq``; ``ps``: ``grad_shard_bytes``,
    ``servers``; ``simple`` and ``local``: none. An unknown option, or one of another
    strategy, is an OptionError naming the valid ones. A ``local`` trainer communicates with
    nobody, also made on one rank of a multi-rank job (to evaluate, or as a one-process
    reference); there the job's NGDIST_CHECKPOINT_* and NGDIST_TIMELINE, which are its
    distributed trainer's, do not apply to it.
    ``reproducible_micro_batch=M`` (allreduce): reproducible mode, every rank's batch is cut
    into micro-batches of ``M`` samples whose gradients, buffer averages and loss are summed
    exactly (``all_reduce_alg="exact"``), so training gives the same bits on any number of
    ranks that are fed the same global batches (passes/reproducible.py).
    ``compression="fp16"|"bf16"`` (allreduce): gradients cross the wire as 16-bit values,
    half the bytes (passes/compression.py); ``compression_error_feedback=True`` carries what
    the rounding lost into the next step.
    ``clip_grad_norm=m``: the averaged gradients scaled to an L2 norm (over all parameters
    together) of at most ``m``, torch's ``clip_grad_norm_``, the same on every rank; the norm
    before clipping is ``StepStats.grad_norm`` and a metrics column. ``clip_grad_value=v``:
    every gradient element clamped to ``[-v, v]`` (passes/clipping.py).
    ``accumulate=k``: each ``trainer.step`` is a micro-step; the gradients of k micro-steps are
    averaged locally and one AllReduce and update run on every k-th (``step(batch,
    sync=False)`` chooses by hand; passes/accumulate.py, runtime/accumulate.py).
    """
    gradients = StepOptions(clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
                            accumulate=accumulate)
    if kvstore is not None:
        from ngdist.compat.kvstore import compile_options
        strategy, optimizer = compile_options(kvstore, strategy, optimizer, _UNSET)
    local_in_job = strategy == "local" and world_rank_size()[1] > 1
    if local_in_job:  # the job's NGDIST_CHECKPOINT_* and NGDIST_TIMELINE are its own trainer's
        folder = os.fspath(checkpoint_dir) if checkpoint_dir is not None else None
        timeline = False if timeline is None else timeline
    else:
        checkpoint_every, folder = _checkpoint_options(checkpoint_every, checkpoint_dir)
    given = locals()  # (the runtime options as given, checkpoint_every and timeline resolved)
    runtime = RuntimeOptions(**{**{n: given[n] for n in RuntimeOptions.names()},
                                "checkpoint_dir": folder})
    if checkpoint_every is not None and checkpoint_every < 1 or checkpoint_keep < 1:
        raise OptionError(f"checkpoint_every and checkpoint_keep must be at least 1, got "
                          f"{checkpoint_every} and {checkpoint_keep}")
    if overlap is not None and strategy == "pushsum":  # also the gossip's overlap
        strategy_options = {"overlap": overlap, **strategy_options}
    chosen = _strategy_options(strategy, strategy_options, also=_KEYWORDS,
                               note=f"; runtime options: {', '.join(RuntimeOptions.names())}")
    frontend = _framework_frontend(model)
    write_back = None
    if frontend is not None:
        if params is not None or output is not None:
            raise GraphError("params= and output= apply to ONNX models; for a framework model "
                             "choose the trained parameters with the optimizer or frozen=")
        given = {k: v for k, v in (("loss", loss), ("optimizer", optimizer)) if v is not _UNSET}
        proto, write_back = frontend.build(model, example_inputs, labels=labels, frozen=frozen,
                                           input_names=input_names, output_names=output_names,
                                           **given)
    else:
        if example_inputs is not None or input_names is not None or output_names is not None:
            raise GraphError("example_inputs, input_names and output_names are for torch and "
                             "Keras models; an ONNX model declares its inputs and outputs")
        proto = to_training_model(model, loss=loss, labels=labels, optimizer=optimizer,
                                  params=params, frozen=frozen, output=output)
    # a local trainer communicates with nobody, also on one rank of a multi-rank job
    group = LocalGroup(runtime.timeout) if strategy == "local" else world_group(runtime.timeout)
    inference, step = split_training_model(proto)
    del proto  # the trainer keeps no whole copy of the values (runtime/state.py): nor does this
    if getattr(chosen, "shard", "none") != "none" or file_layout(inference) is not None:
        # ZeRO-1/2/3, or a file written by ngdist rewrite --shard (ngdist/sharded.py)
        return compile_sharded(inference, step, chosen, group, gradients,  # type: ignore[arg-type]
                               runtime.as_kwargs(), write_back)
    step = run_passes(step, chosen, gradients=gradients)
    # ps: the Trainer sets up the shard owners; a dedicated server serves until workers stop
    return Trainer(inference, step=step, group=group, write_back=write_back,
                   **runtime.as_kwargs())


# every keyword compile takes, for the "did you mean" of a misspelt one
_KEYWORDS = [p for p in inspect.signature(compile).parameters
             if p not in ("model", "strategy_options")]
