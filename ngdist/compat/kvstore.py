"""An MXNet-KVStore-style key-value store for data-parallel training, on MPI (no mxnet needed).

    kv = ngdist.kvstore.create("dist_sync")
    kv.init("w", w0)                 # rank 0's value is everyone's
    kv.set_optimizer(ngdist.optim.SGD(lr=0.1, momentum=0.9))
    for batch in ...:
        kv.push("w", grad_w)         # gradients of this worker, from any framework or numpy
        kv.pull("w", out=w)          # the updated weights, identical on every worker

Semantics follow MXNet's KVStore:

* keys are ints or strings, or lists of them with one value (or out) per key;
* ``push`` of a list of arrays for one key sums them (MXNet: one array per device); the store
  then applies the optimizer (``set_optimizer``) to its value with the merged gradient, or,
  without an optimizer, *replaces* its value by the merged gradient;
* ``pull`` copies the value into ``out`` (an array, or a list of arrays: each one is filled);
  ``pushpull`` is push then pull; ``init`` twice for a key, or push/pull of a key never
  initialized, is a :class:`KVStoreError`.

Types (``create(name)``):

* ``local``: one process (``rank`` 0, ``num_workers`` 1), no communication.
* ``dist_sync``: the ``ps`` strategy's parameter servers (kernels/ps.py), co-located, one
  shard per key, owned round-robin in ``init`` order. A push sends each worker's merged
  gradient to the key's owner, which sums them in worker order (a sum, not ``ps``'s mean),
  applies the optimizer (optimizer state only there) and sends the new value to every worker;
  ``pull`` copies locally: every worker holds bit-for-bit the owner's value.
* ``dist_allreduce``: the pushes are summed on every worker (``Allreduce``, Horovod's way) and
  every worker applies the same update to its replica.
* ``pushsum``: Stochastic Gradient Push; each worker applies its own update to its push-sum
  numerator, then gossips numerator and weight with one peer of the exponential graph (the
  ``PushSum`` kernel of the ``pushsum`` strategy); ``pull`` returns the de-biased ``x / w``.

Without parameter servers the distributed types are collective: every worker issues the same
``init``/``push``/``pull`` calls in the same order (a data-parallel loop does). ``init`` checks
that all workers name the same key with the same shape, so a mismatch is an error, not a hang;
every wait is bounded by the communicator's timeout (``create(..., timeout=)``/NGDIST_TIMEOUT).
Every message goes through the job's ProcessGroup (comm/group.py), dist_sync's through the
parameter-server round of kernels/ps.py (on the store's duplicate of the group, made by the
first ``init``; a failed wait names the key and the owner rank), pushsum's through the
PushSum kernel.

The optimizers are ngdist's (``ngdist.optim.SGD``/``Adam``/``Adagrad`` or "sgd:lr=0.1"): the
update is the ONNX ``Momentum``/``Adam``/``Adagrad`` op lowered by ngdist's own pass and run by
onnxruntime, exactly what ``ngdist.compile`` runs; a callable ``updater(key, grad, weight)``
returning the new weight works too. ``ngdist.compile(model, kvstore=kv)`` picks the strategy
from the type (see :func:`compile_options`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from ngdist import optim
from ngdist.errors import NgdistError
from ngdist.ir.domain import PREVIEW_TRAINING
from ngdist.passes.optimizers.common import make_optimizer_node
from ngdist.passes.options import TypedOptions, refuse_unknown
from ngdist.comm import world_group
from ngdist.kernels import CommNode, get_kernel
from ngdist.kernels.ps import Layout, PSGroup, Waiting, complete, push_pull
from ngdist.runtime.sessions import make_session

logger = logging.getLogger(__name__)

TYPES = ("local", "dist_sync", "dist_allreduce", "pushsum")
STRATEGY_OF = {"local": "local", "dist_sync": "allreduce", "dist_allreduce": "allreduce",
               "pushsum": "pushsum"}

Key = int | str
Updater = Callable[[Key, np.ndarray, np.ndarray], np.ndarray | None]


class KVStoreError(NgdistError):
    """A key-value store call that cannot be honoured (unknown key, double init, bad shape)."""


@dataclass(frozen=True)
class _CreateOptions(TypedOptions):
    """The options of ``create``, typed."""

    owner: ClassVar[str] = "ngdist.kvstore.create"
    name: str = "local"
    timeout: float | None = None


def create(name: str = "local", timeout: float | None = None, **unknown: Any) -> KVStore:
    """A key-value store of type ``local``, ``dist_sync``, ``dist_allreduce`` or ``pushsum``;
    ``timeout``: seconds before a stuck message fails. Any other keyword is an OptionError."""
    refuse_unknown(unknown, "ngdist.kvstore.create", ("name", "timeout"))
    _CreateOptions(name=name, timeout=timeout)  # types
    if name not in TYPES:
        raise KVStoreError(f"unknown kvstore type {name!r}; choose one of {list(TYPES)}")
    return KVStore(name, timeout)


# ----------------------------------------------------------------------------- updates

class OnnxUpdater:
    """Applies an ngdist optimizer to one key at a time: the preview-training op, lowered by
    ngdist's OptimizerLoweringPass, run by onnxruntime. State (momentum, moments, step count)
    is kept per key."""

    def __init__(self, optimizer: optim.Optimizer, rescale_grad: float = 1.0) -> None:
        self.optimizer = optimizer
        self.rescale_grad = float(rescale_grad)
        self.states: dict[Key, list[np.ndarray]] = {}
        self.steps: dict[Key, int] = {}
        self._sessions: dict[np.dtype, ort.InferenceSession] = {}

    def _session(self, dtype: np.dtype) -> ort.InferenceSession:
        if dtype not in self._sessions:
            if dtype not in (np.float32, np.float64):
                raise KVStoreError(f"the optimizer updates float32 or float64 values, not {dtype}")
            from ngdist.compat.backend import lower_training_ops

            opt = self.optimizer
            elem = TensorProto.FLOAT if dtype == np.float32 else TensorProto.DOUBLE
            states = [f"S{i}" for i in range(len(opt.state_suffixes))]
            node = make_optimizer_node(opt.op_type, ["R", "T", "X", "G", *states],
                                       ["X_new", *[f"{s}_new" for s in states]],
                                       opt.attributes())
            vi = helper.make_tensor_value_info
            graph = helper.make_graph(
                [node], "kvstore_update",
                [vi("R", TensorProto.FLOAT, []), vi("T", TensorProto.INT64, []),
                 *[vi(n, elem, None) for n in ["X", "G", *states]]],
                [vi(o, elem, None) for o in node.output])
            model = helper.make_model(graph, opset_imports=[
                helper.make_opsetid("", 18), helper.make_opsetid(PREVIEW_TRAINING, 1)])
            self._sessions[dtype] = make_session(lower_training_ops(model))
        return self._sessions[dtype]

    def __call__(self, key: Key, grad: np.ndarray, weight: np.ndarray) -> np.ndarray:
        opt = self.optimizer
        if key not in self.states:
            self.states[key] = [np.zeros_like(weight) for _ in opt.state_suffixes]
            self.steps[key] = 0
        if self.rescale_grad != 1.0:
            grad = grad * weight.dtype.type(self.rescale_grad)
        feeds = {"R": np.array(opt.lr, np.float32),
                 "T": np.array(self.steps[key] + opt.step_offset, np.int64),
                 "X": weight, "G": grad.astype(weight.dtype, copy=False)}
        feeds.update({f"S{i}": s for i, s in enumerate(self.states[key])})
        new_x, *new_states = self._session(weight.dtype).run(None, feeds)
        self.states[key] = new_states
        self.steps[key] += 1
        return new_x


# ----------------------------------------------------------------------------- the store

@dataclass
class _Entry:
    value: np.ndarray  # the weight (dist_sync: the owner's, copied to every worker by a push)
    shard: int = -1  # dist_sync: this key's shard in the store's parameter-server layout
    ps_weight: np.ndarray | None = None  # pushsum: the push-sum weight w
    gossip: Any = None  # pushsum: the kernel's CommNode (its state persists across pushes)


class KVStore:
    """See the module docstring. Create with :func:`create`."""

    def __init__(self, kind: str, timeout: float | None = None) -> None:
        self.type = kind
        self.comm = world_group(timeout)
        self._distributed = kind != "local" and self.comm.size > 1
        self._entries: dict[Key, _Entry] = {}
        self._updater: Updater | None = None
        self.optimizer: optim.Optimizer | None = None
        self._ps: PSGroup | None = None  # dist_sync: one shard per key (made by the first init)
        self._shard_keys: list[Key] = []  # dist_sync: the key of each shard
        self._ps_label = Waiting("", f"kvstore {kind} push")

    # ------------------------------------------------------------------ identity
    @property
    def rank(self) -> int:
        return self.comm.rank if self.type != "local" else 0

    @property
    def num_workers(self) -> int:
        return self.comm.size if self.type != "local" else 1

    def barrier(self) -> None:
        """Blocks until every worker has reached it (bounded by the timeout)."""
        if self._distributed:
            self.comm.barrier("kvstore barrier").wait()

    # ------------------------------------------------------------------ API
    def init(self, key: Key | Sequence[Key], value: Any) -> None:
        """Initializes keys; in the distributed types rank 0's values are everyone's."""
        for k, values in _pairs(key, value, "init"):
            if k in self._entries:
                raise KVStoreError(f"key {k!r} is already initialized; init each key once "
                                   "(push changes its value)")
            if len(values) != 1:
                raise KVStoreError(f"init of key {k!r} takes one array, got a list of "
                                   f"{len(values)}")
            arr = np.array(values[0], copy=True, order="C")
            if self._distributed:
                self.comm.check_same(f"{k!r}:{arr.shape}:{arr.dtype}".encode(),
                                     f"kvstore key {k!r} (name, shape, dtype) in init")
                self.comm.broadcast_arrays([arr], root=0, what=f"kvstore init of key {k!r}")
            entry = _Entry(arr)
            if self.type == "dist_sync" and self._distributed:
                entry.shard = self._layout().append(arr.size, f"key {k!r}")
                self._shard_keys.append(k)
            if self.type == "pushsum":
                entry.ps_weight = np.ones((), arr.dtype)
                entry.gossip = CommNode("PushSum", f"kvstore/{k}", {
                    "graph": "exponential", "peers_per_itr": 1, "overlap": 0, "synch_freq": 0})
            self._entries[k] = entry

    def push(self, key: Key | Sequence[Key], value: Any, priority: int = 0) -> None:
        """Pushes values (a list for one key is summed); ``priority`` is accepted and ignored."""
        pushes = [(k, self._entry(k, "push"), values) for k, values in _pairs(key, value, "push")]
        merged = [(k, entry, _merge(k, values, entry.value)) for k, entry, values in pushes]
        if self.type == "dist_sync" and self._distributed:
            self._push_sync(merged)
            return
        for k, entry, grad in merged:
            if self.type == "dist_allreduce" and self._distributed:
                self.comm.allreduce(grad, f"kvstore push of key {k!r} (Allreduce)").wait()
            entry.value = self._apply(k, grad, entry.value)
            if self.type == "pushsum":
                x, w = get_kernel("PushSum")(
                    self.comm, entry.gossip, [entry.value, entry.ps_weight])
                entry.value, entry.ps_weight = np.array(x), np.array(w)

    def pull(self, key: Key | Sequence[Key], out: Any = None, priority: int = 0,
             ignore_sparse: bool = True) -> Any:
        """Copies each key's value into ``out`` (an array or a list of arrays, each filled).
        Without ``out`` the values are returned (a copy; a list for a list of keys)."""
        keys = list(key) if isinstance(key, (list, tuple)) else [key]
        if out is None:
            outs: list[Any] = [None] * len(keys)
        elif isinstance(key, (list, tuple)):
            if not isinstance(out, (list, tuple)) or len(out) != len(keys):
                raise KVStoreError(f"pull of {len(keys)} keys needs a list of {len(keys)} outs")
            outs = list(out)
        else:
            outs = [out]
        results = []
        for k, o in zip(keys, outs):
            _check_key(k)
            value = self._current(k)
            if o is None:
                results.append(value.copy())
                continue
            targets = list(o) if isinstance(o, (list, tuple)) else [o]
            for t in targets:
                if not isinstance(t, np.ndarray) or t.shape != value.shape:
                    raise KVStoreError(f"pull of key {k!r}: out must be a numpy array of shape "
                                       f"{value.shape}, got "
                                       f"{getattr(t, 'shape', type(t).__name__)}")
                t[...] = value
        if out is None:
            return results if isinstance(key, (list, tuple)) else results[0]
        return None

    def pushpull(self, key: Key | Sequence[Key], value: Any, out: Any = None,
                 priority: int = 0) -> Any:
        """push then pull (with ``out=None`` the pulled values are returned)."""
        self.push(key, value, priority)
        return self.pull(key, out, priority)

    def set_optimizer(self, optimizer: optim.Optimizer | str | Updater,
                      rescale_grad: float = 1.0) -> None:
        """The update applied where a key lives: an ngdist optimizer (or its spec string), or a
        callable ``updater(key, grad, weight) -> new weight``. ``rescale_grad`` multiplies the
        merged gradient first (MXNet's, e.g. 1/global batch size for summed losses)."""
        if callable(optimizer):
            scale = float(rescale_grad)
            self._updater = optimizer if scale == 1.0 else \
                (lambda k, g, w: optimizer(k, g * w.dtype.type(scale), w))
            self.optimizer = None
            return
        opt = optim.from_spec(optimizer)
        if self._distributed:
            self.comm.check_same(repr((opt, rescale_grad)).encode(), "kvstore optimizer")
        self.optimizer = opt
        self._updater = OnnxUpdater(opt, rescale_grad)

    # ------------------------------------------------------------------ internals
    def _entry(self, key: Key, what: str) -> _Entry:
        _check_key(key)
        try:
            return self._entries[key]
        except KeyError:
            known = ", ".join(sorted(map(repr, self._entries))) or "none"
            raise KVStoreError(f"{what} of key {key!r}, which was never initialized; call "
                               f"init({key!r}, value) first (initialized keys: {known})"
                               ) from None

    def _layout(self) -> Layout:
        """dist_sync: one shard per key; the first call (collective) duplicates the group."""
        if self._ps is None:
            size = self.comm.size
            self._ps = PSGroup(Layout(0, [], [], size, size),
                               self.comm.dup("kvstore dist_sync set-up"))
        return self._ps.layout

    def _push_sync(self, merged: list[tuple[Key, _Entry, np.ndarray]]) -> None:
        """dist_sync: one parameter-server round per run of distinct keys (a key pushed twice
        in one call starts a new round); the owners sum (MXNet), every entry gets the owner's
        new value."""
        rounds: list[dict[int, _Entry]] = [{}]
        grads: list[dict[int, np.ndarray]] = [{}]
        for _, entry, grad in merged:
            if entry.shard in rounds[-1]:
                rounds.append({})
                grads.append({})
            rounds[-1][entry.shard], grads[-1][entry.shard] = entry, grad
        for entries, grad in zip(rounds, grads):
            outs = {shard: entry.value for shard, entry in entries.items()}
            complete(push_pull(self.comm, self._ps_label, self._ps, grad, outs,
                               self._update_shard, "sum"))

    def _update_shard(self, shard: int, total: np.ndarray) -> np.ndarray:
        """dist_sync, on the owner of the key of ``shard``: its update by the summed gradient."""
        key = self._shard_keys[shard]
        return self._apply(key, total, self._entries[key].value)

    def _apply(self, key: Key, grad: np.ndarray, weight: np.ndarray) -> np.ndarray:
        if self._updater is None:
            return grad.astype(weight.dtype, copy=True)  # MXNet: no updater assigns
        new = self._updater(key, grad, weight)
        return weight if new is None else np.ascontiguousarray(new, dtype=weight.dtype)

    def _current(self, key: Key) -> np.ndarray:
        entry = self._entry(key, "pull")
        if self.type == "pushsum":
            return entry.value / entry.ps_weight
        return entry.value  # dist_sync: the owner's value, delivered by the push


def _check_key(key: Any) -> None:
    if isinstance(key, bool) or not isinstance(key, (int, str)):
        raise KVStoreError(f"kvstore keys are ints or strings, got {type(key).__name__} "
                           f"{key!r}")


def _pairs(key: Any, value: Any, what: str) -> list[tuple[Key, list[np.ndarray]]]:
    """[(key, [arrays])] from MXNet's forms: key + array, key + list, keys + list per key."""
    if isinstance(key, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(key):
            raise KVStoreError(f"{what} of {len(key)} keys needs a list of {len(key)} values "
                               f"(one per key), got "
                               f"{len(value) if isinstance(value, (list, tuple)) else 1}")
        pairs = [(k, list(v) if isinstance(v, (list, tuple)) else [v])
                 for k, v in zip(key, value)]
    else:
        pairs = [(key, list(value) if isinstance(value, (list, tuple)) else [value])]
    for k, values in pairs:
        _check_key(k)
        if not values:
            raise KVStoreError(f"{what} of key {k!r} got an empty list of values")
    return pairs


def _merge(key: Key, values: list[Any], like: np.ndarray) -> np.ndarray:
    """The sum of the pushed arrays (left to right), in the key's dtype, contiguous."""
    total = None
    for v in values:
        arr = np.asarray(v)
        if arr.shape != like.shape:
            raise KVStoreError(f"push to key {key!r}: a value has shape {arr.shape}, the key "
                               f"holds {like.shape}")
        if total is None:
            total = arr.astype(like.dtype, copy=True)
        else:
            total += arr
    return np.ascontiguousarray(total)


def compile_options(kvstore: KVStore, strategy: str, optimizer: Any, unset: Any = None
                    ) -> tuple[str, Any]:
    """(strategy, optimizer) for ``ngdist.compile(..., kvstore=kv)``: the type decides the comm
    ops (dist_sync/dist_allreduce -> allreduce, pushsum -> pushsum, local -> local); the
    store's ngdist optimizer is used when compile is given none."""
    from ngdist.passes.pipeline import STRATEGIES

    if not isinstance(kvstore, KVStore):
        raise KVStoreError(f"kvstore= takes a store from ngdist.kvstore.create(), got "
                           f"{type(kvstore).__name__}")
    chosen = STRATEGY_OF[kvstore.type]
    if chosen not in STRATEGIES:
        raise KVStoreError(f"kvstore type {kvstore.type!r} needs the {chosen!r} strategy, which "
                           f"is not available in this ngdist (strategies: {sorted(STRATEGIES)})")
    if strategy not in ("allreduce", chosen):  # "allreduce" is compile's default
        raise KVStoreError(f"strategy={strategy!r} conflicts with kvstore type "
                           f"{kvstore.type!r}, which uses {chosen!r}; pass one of them")
    if optimizer is unset and kvstore.optimizer is not None:
        optimizer = kvstore.optimizer
    return chosen, optimizer
