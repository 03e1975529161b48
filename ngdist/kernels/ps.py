"""Sharded parameter servers: the one implementation, used by ``ngdist.PSPushPull`` (Ray SGD's
``ps`` strategy) and by the ``dist_sync`` key-value store (MXNet's, compat/kvstore.py).

A :class:`Layout` cuts values into shards and deals them round-robin to their owners. For the
``ps`` strategy the parameters (one element type) are one flat vector cut into shards of at
most ``grad_shard_bytes``; the owners are every rank (co-located: each worker also serves some
shards) or the last ``K`` ranks (dedicated servers, ``NGDIST_PS_SERVERS=K`` as set by
``ngdist run --servers K``, or ``servers=K`` in the graph); workers are ranks
``0 .. size-K-1``. For the key-value store each key is one shard (``Layout.append``, in
``init`` order) and every rank is a worker and an owner. One round (:func:`push_pull`), on
every worker:

1. push: each gradient shard goes to its owner (``send``);
2. each owner sums the ``W`` workers' shards in worker order, reduces them as the caller says
   (``mean``: divide by ``W``, the same mean as AllReduce, for the ``ps`` strategy; ``sum``:
   MXNet's KVStore, whose ``rescale_grad`` is the user's way to average), applies the caller's
   update to the result (a :data:`ShardUpdate`: the ``ps`` strategy's is the node's ``update``
   graph, the lowered optimizer, run by onnxruntime on the slice with the optimizer state kept
   in :class:`Shards`; the key-value store's is its optimizer, its Python updater, or the
   assignment of the merged gradient) and sends the new value to every other worker;
3. pull: each worker receives every shard it does not own.

Each shard is computed by exactly one owner and copied, so every worker holds bit-for-bit
the same values, and the optimizer state exists only on the owners. For the ``ps`` strategy
the state inputs of the node are read once, as the owners' initial values; workers drive
dedicated servers with a header ``[command, lr, t]`` per round (step, save, stop); the server
side is runtime/ps_server.py. All messages use a duplicate of the group; every message is a
Work whose label names the shard (``Layout.name``: ``shard 3``, or ``key 'w'`` in the store) and
the peer's role, so a dead or frozen owner ends in an error that says which rank it was.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import numpy as np
import onnx

from ngdist.errors import CommError
from ngdist.kernels.base import CommNode, flatten, register_kernel, unflatten

if TYPE_CHECKING:
    from ngdist.comm.group import ProcessGroup, Work

logger = logging.getLogger(__name__)

SERVERS_ENV = "NGDIST_PS_SERVERS"
UPDATE_OPSET = 18  # the update graph uses ops that are unchanged from opset 15 to 23
STEP, STOP, SAVE = 1, 2, 3
TAG_HDR, TAG_GRAD, TAG_PARAM, TAG_STATE, TAG_FINAL = 11, 12, 13, 14, 16
COMMANDS = {STEP: "step", STOP: "stop", SAVE: "save"}

Reduction = Literal["sum", "mean"]
REDUCTIONS: tuple[str, ...] = ("sum", "mean")
PS_REDUCTION: Reduction = "mean"  # the ps strategy averages the gradients, as AllReduce does
# the owner's update of one shard: (shard id, reduced gradient) -> the shard's new value
ShardUpdate = Callable[[int, np.ndarray], np.ndarray]


def env_servers() -> int:
    raw = os.environ.get(SERVERS_ENV, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise CommError(f"{SERVERS_ENV}={raw!r} is not a number of server ranks") from None


def resolve_servers(attr_servers: int, size: int) -> int:
    """Dedicated server ranks: the graph's ``servers`` if set, else the launcher's env var."""
    k, env = int(attr_servers), env_servers()
    if k and env and env != k:
        raise CommError(f"the model asks for {k} parameter server rank(s) but {SERVERS_ENV}="
                        f"{env} (ngdist run --servers); make them agree")
    k = k or env
    if k < 0 or (k and k >= size):
        raise CommError(f"{k} parameter server rank(s) need more than {k} ranks, and this job "
                        f"has {size}; launch e.g. `ngdist run -n {k + 2} --servers {k} -- ...`")
    return k


# --------------------------------------------------------------------------- layout and owners

@dataclass
class Layout:
    """How values are cut into shards (``bounds`` in one flat vector), and who owns each."""

    total: int
    bounds: list[tuple[int, int]]
    owners: list[int]
    workers: int  # ranks 0 .. workers-1 train; the rest (if any) are dedicated servers
    size: int
    names: list[str] = field(default_factory=list)  # the labels' name of each shard ("shard k")

    @property
    def servers(self) -> list[int]:
        return list(range(self.workers, self.size))

    def owned(self, rank: int) -> list[int]:
        return [k for k, o in enumerate(self.owners) if o == rank]

    def name(self, k: int) -> str:
        return self.names[k] if k < len(self.names) else f"shard {k}"

    def deal(self, k: int) -> int:
        """The owner of shard ``k``: the owner ranks (the servers, else every rank) in turn."""
        owners = self.servers or list(range(self.size))
        return owners[k % len(owners)]

    def append(self, length: int, name: str) -> int:
        """A new last shard of ``length`` elements, called ``name``, dealt to the next owner
        (the key-value store's keys, in ``init`` order); returns its id."""
        k = len(self.bounds)
        self.bounds.append((self.total, self.total + length))
        self.total += length
        self.owners.append(self.deal(k))
        self.names += [f"shard {i}" for i in range(len(self.names), k)] + [name]
        return k


def make_layout(total: int, itemsize: int, grad_shard_bytes: int, size: int,
                servers: int) -> Layout:
    """Shards of nearly equal length, each at most ``grad_shard_bytes`` (0: one per owner),
    dealt round-robin to the owners."""
    lay = Layout(total, [], [], size - servers, size)
    if grad_shard_bytes > 0:
        per = max(1, grad_shard_bytes // itemsize)
        count = max(1, -(-total // per))
    else:
        count = len(lay.servers) or size
    count = max(1, min(count, total))
    lay.bounds = [(total * k // count, total * (k + 1) // count) for k in range(count)]
    lay.owners = [lay.deal(k) for k in range(count)]
    return lay


class Shards:
    """The ``ps`` strategy's shards on one rank: their parameters, optimizer state and update
    session (``make_session(graph) -> session``, the runtime's session factory, handed in)."""

    def __init__(self, layout: Layout, rank: int, update: onnx.GraphProto,
                 make_session: Any) -> None:
        self.layout = layout
        self.ids = layout.owned(rank)
        self.x: dict[int, np.ndarray] = {}
        self.state: dict[int, list[np.ndarray]] = {}
        self.names = [i.name for i in update.input]  # lr, t, x, g, state...
        self.lr_dtype = onnx.helper.tensor_dtype_to_np_dtype(
            update.input[0].type.tensor_type.elem_type)
        self.kinds = len(update.input) - 4
        self.session: Any = None
        if self.ids:
            self.session = make_session(update, UPDATE_OPSET)

    def load(self, flat_x: np.ndarray, flat_states: list[np.ndarray] | None) -> None:
        """Take the owned slices of the flat parameters (and state; None keeps the state)."""
        for k in self.ids:
            lo, hi = self.layout.bounds[k]
            self.x[k] = flat_x[lo:hi].copy()
            if flat_states is not None:
                self.state[k] = [s[lo:hi].copy() for s in flat_states]

    def update(self, k: int, grad: np.ndarray, lr: float, t: int) -> np.ndarray:
        feeds = dict(zip(self.names, [np.asarray(lr, self.lr_dtype), np.asarray(t, np.int64),
                                      self.x[k], grad, *self.state[k]]))
        x_new, *states = self.session.run(None, feeds)
        self.x[k], self.state[k] = x_new, states
        return x_new

    def updater(self, lr: float, t: int) -> ShardUpdate:
        """This round's update of a shard (learning rate ``lr``, step ``t``)."""
        return lambda k, grad: self.update(k, grad, lr, t)


@dataclass
class PSGroup:
    """What the messages of a round need: the layout and the private group."""

    layout: Layout
    group: ProcessGroup  # a duplicate of the caller's group: these messages match no other

    @property
    def dedicated(self) -> bool:
        return self.layout.workers < self.layout.size


@dataclass
class PSRuntime(PSGroup):
    """Everything a rank keeps for one PSPushPull node (in ``CommNode.state['ps']``)."""

    shards: Shards
    shapes: list[np.ndarray] = field(default_factory=list)  # empty arrays shaped like the params
    dtype: Any = np.float32
    stopped: bool = False
    lockstep: bool = False  # dedicated servers follow the program (DistributedSGD)


def split_inputs(node: CommNode, inputs: list[Any]) -> tuple[Any, Any, list, list, list[list]]:
    """(lr, t, params, grads, [state kind 0 params, ...]) of the node's inputs."""
    n = len(node.outputs)
    xs, gs, rest = inputs[2:2 + n], inputs[2 + n:2 + 2 * n], inputs[2 + 2 * n:]
    kinds = len(rest) // n if n else 0
    return inputs[0], inputs[1], xs, gs, [rest[i * n:(i + 1) * n] for i in range(kinds)]


def make_runtime(comm: ProcessGroup, node: CommNode, xs: list[np.ndarray],
                 states: list[list[np.ndarray]], make_session: Any) -> PSRuntime:
    """Layout, private communicator (collective over all ranks) and this rank's shards, kept
    in the node's state (the kernel's own) and returned."""
    servers = resolve_servers(int(node.attributes["servers"]), comm.size)
    flat_x = flatten(xs)
    layout = make_layout(flat_x.size, flat_x.itemsize, int(node.attributes[
        "grad_shard_bytes"]), comm.size, servers)
    # a duplicate per runtime, made here on every rank (a cache keyed by the group's id could
    # hand one rank a stale duplicate when a freed group's id is reused)
    group = comm.dup("parameter-server set-up")
    shards = Shards(layout, comm.rank, node.attributes["update"], make_session)
    shards.load(flat_x, [flatten(group) for group in states])
    logger.info("ps: rank %d owns shards %s of %d (%d worker(s), %d server(s))", comm.rank,
                shards.ids, len(layout.bounds), layout.workers, servers)
    rt = node.state["ps"] = PSRuntime(layout, group, shards,
                                      [np.empty(np.shape(x), flat_x.dtype) for x in xs],
                                      flat_x.dtype)
    return rt


def runtime_of(node: CommNode) -> PSRuntime | None:
    """The node's parameter-server runtime (``make_runtime``), or None before it is made."""
    return node.state.get("ps")


# --------------------------------------------------------------------------- one round

class Waiting(NamedTuple):
    """What a wait is for, as the timeout message names it (``comm.timeout_message``)."""

    op_type: str
    name: str


def role(ps: PSGroup, rank: int) -> str:
    if rank >= ps.layout.workers:
        return f"parameter server rank {rank}"
    return f"worker rank {rank}" + (" (co-located shard owner)" if not ps.dedicated else "")


def send(ps: PSGroup, node: Any, buf: np.ndarray, peer: int, tag: int, what: str) -> Work:
    """One message to ``peer``; its Work's errors say which shard or round, and who."""
    return ps.group.exchange([(buf, peer)], [], tag, Waiting(
        node.op_type, f"{node.name}: {what} {role(ps, peer)}"))


def recv(ps: PSGroup, node: Any, buf: np.ndarray, peer: int, tag: int, what: str) -> Work:
    return ps.group.exchange([], [(buf, peer)], tag, Waiting(
        node.op_type, f"{node.name}: {what} {role(ps, peer)}"))


def recv_owner(ps: PSGroup, node: Any, buf: np.ndarray, k: int, tag: int, what: str) -> Work:
    return recv(ps, node, buf, ps.layout.owners[k], tag,
                f"{what} of {ps.layout.name(k)} from")


def owner_round(ps: PSGroup, node: Any, shards: Mapping[int, np.ndarray]
                ) -> dict[int, list[tuple[int, np.ndarray, Work | None]]]:
    """Post the receives of every worker's gradient of ``shards``, the shards of this round
    that this rank owns: shard id -> this rank's own gradient of it (a worker, which also
    counts), or an array shaped like it (a dedicated server)."""
    lay, me = ps.layout, ps.group.rank
    recvs: dict[int, list[tuple[int, np.ndarray, Work | None]]] = {}
    for k, mine in shards.items():
        rows: list[tuple[int, np.ndarray, Work | None]] = []
        for w in range(lay.workers):
            if w == me:
                rows.append((w, mine, None))
            else:
                buf = np.empty_like(mine)
                rows.append((w, buf, recv(ps, node, buf, w, TAG_GRAD,
                                          f"gradient of {lay.name(k)} from")))
        recvs[k] = rows
    return recvs


def finish_owner_round(comm: ProcessGroup, node: Any, ps: PSGroup,
                       recvs: dict[int, list[tuple[int, np.ndarray, Work | None]]],
                       update: ShardUpdate, outs: Mapping[int, np.ndarray] | None,
                       reduction: Reduction) -> list[Work]:
    """For each shard of ``recvs``: sum the workers' gradients in worker order (``mean``
    divides floats by the number of workers), ``update`` it, copy the new value into
    ``outs[k]`` when given, and send it to every other worker. Returns the sends."""
    if reduction not in REDUCTIONS:
        raise CommError(f"parameter-server reduction {reduction!r}: choose one of "
                        f"{list(REDUCTIONS)}")
    lay, me, sends = ps.layout, ps.group.rank, []
    for k, rows in recvs.items():
        acc = None
        for w, buf, work in rows:  # worker order: the same sum on any owner
            if work is not None:
                work.wait()
            acc = buf.copy() if acc is None else np.add(acc, buf, out=acc)
        if reduction == "mean" and acc.dtype.kind == "f":
            acc /= acc.dtype.type(lay.workers)
        x_new = update(k, acc)
        dst = None if outs is None else outs.get(k)
        if dst is not None and dst is not x_new:
            dst[...] = x_new
        for w in range(lay.workers):
            if w != me:
                sends.append(send(ps, node, x_new, w, TAG_PARAM,
                                  f"delivery of the update of {lay.name(k)} to"))
                comm.bytes_sent += x_new.nbytes
    return sends


def push_pull(comm: ProcessGroup, node: Any, ps: PSGroup, grads: Mapping[int, np.ndarray],
              outs: Mapping[int, np.ndarray], update: ShardUpdate, reduction: Reduction
              ) -> list[Work]:
    """One round on a worker over the shards of ``grads`` (shard id -> this worker's
    gradient): every gradient to its owner, the owned shards reduced and updated here, every
    shard's new value into ``outs[k]``. The pulls are complete on return; the sends are
    returned (the caller completes them)."""
    lay, me = ps.layout, ps.group.rank
    recvs = owner_round(ps, node, {k: g for k, g in grads.items() if lay.owners[k] == me})
    pulls, sends = [], []
    for k, g in grads.items():
        owner = lay.owners[k]
        if owner != me:
            pulls.append(recv_owner(ps, node, outs[k], k, TAG_PARAM, "update"))
            sends.append(send(ps, node, g, owner, TAG_GRAD,
                              f"delivery of the gradient of {lay.name(k)} to"))
            comm.bytes_sent += g.nbytes
    sends += finish_owner_round(comm, node, ps, recvs, update, outs, reduction)
    complete(pulls)
    return sends


def header(ps: PSGroup, node: Any, command: int, lr: float = 0.0, t: int = 0) -> list[Work]:
    """Worker -> every dedicated server: the round's command (and lr, t for a step)."""
    if not ps.dedicated:
        return []
    hdr = np.array([command, lr, t], np.float64)
    return [send(ps, node, hdr, s, TAG_HDR, "delivery of a message to")
            for s in ps.layout.servers]


def complete(works: list[Work]) -> None:
    for work in works:
        work.wait()


@register_kernel("PSPushPull")
def ps_push_pull(comm: ProcessGroup, node: CommNode, inputs: list[Any]) -> list[np.ndarray]:
    lr_in, t_in, xs, gs, states = split_inputs(node, list(inputs))
    rt = runtime_of(node)
    if rt is None:
        raise CommError(f"ngdist.PSPushPull '{node.name}' ran before its parameter-server "
                        "set-up; the Trainer sets it up on every rank at start")
    lay = rt.layout
    lr, t = float(np.asarray(lr_in)), int(np.asarray(t_in))
    grad = flatten(gs)
    out = np.empty(lay.total, rt.dtype)
    sends = header(rt, node, STEP, lr, t)
    if not rt.dedicated:  # co-located: the workers' parameters are the owners' (bit-identical)
        flat_x = flatten(xs)
        for k in rt.shards.ids:
            lo, hi = lay.bounds[k]
            rt.shards.x[k] = flat_x[lo:hi].copy()
    grads = {k: grad[lo:hi] for k, (lo, hi) in enumerate(lay.bounds)}
    outs = {k: out[lo:hi] for k, (lo, hi) in enumerate(lay.bounds)}
    sends += push_pull(comm, node, rt, grads, outs, rt.shards.updater(lr, t), PS_REDUCTION)
    complete(sends)
    return unflatten(out, rt.shapes)
