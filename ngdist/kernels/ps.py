"""Kernels of ``ngdist.PSPushPull``: sharded parameter servers (Ray SGD's ``ps`` strategy).

The parameters (one element type) are viewed as one flat vector cut into shards of at most
``grad_shard_bytes``; shard ``k`` belongs to ``owners[k % len(owners)]``. The owners are every
rank (co-located: each worker also serves some shards) or the last ``K`` ranks (dedicated
servers, ``NGDIST_PS_SERVERS=K`` as set by ``ngdist run --servers K``, or ``servers=K`` in the
graph); workers are ranks ``0 .. size-K-1``. One step, on every worker:

1. push: each gradient shard goes to its owner (``Isend``);
2. each owner sums the ``W`` workers' shards in worker order, divides by ``W`` (the same mean
   as AllReduce), runs the node's ``update`` graph (the lowered optimizer) on its slice with
   onnxruntime, keeps the new slice and its optimizer state, and sends the slice to every
   worker;
3. pull: each worker receives every shard it does not own and returns the new parameters.

Each shard is computed by exactly one owner and copied, so every worker holds bit-for-bit
the same parameters. The optimizer state exists only on the owners (``Shards``); the state
inputs of the node are read once, as the owners' initial values. Workers drive dedicated
servers with a header ``[command, lr, t]`` per round (step, save, stop); the server side is
runtime/ps_server.py. All messages use a duplicate of the group; every message is a Work
whose label names the shard and the peer's role, so a dead or frozen owner ends in a
timeout error that says which rank it was.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import onnx

from ngdist.errors import CommError
from ngdist.kernels.base import CommNode, flatten, private_group, register_kernel, unflatten

logger = logging.getLogger(__name__)

SERVERS_ENV = "NGDIST_PS_SERVERS"
UPDATE_OPSET = 18  # the update graph uses ops that are unchanged from opset 15 to 23
STEP, STOP, SAVE = 1, 2, 3
TAG_HDR, TAG_GRAD, TAG_PARAM, TAG_STATE, TAG_FINAL = 11, 12, 13, 14, 16
COMMANDS = {STEP: "step", STOP: "stop", SAVE: "save"}


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
    """How the flat parameter vector is cut into shards, and who owns each shard."""

    total: int
    bounds: list[tuple[int, int]]
    owners: list[int]
    workers: int  # ranks 0 .. workers-1 train; the rest (if any) are dedicated servers
    size: int

    @property
    def servers(self) -> list[int]:
        return list(range(self.workers, self.size))

    def owned(self, rank: int) -> list[int]:
        return [k for k, o in enumerate(self.owners) if o == rank]


def make_layout(total: int, itemsize: int, grad_shard_bytes: int, size: int,
                servers: int) -> Layout:
    """Shards of nearly equal length, each at most ``grad_shard_bytes`` (0: one per owner),
    dealt round-robin to the owners."""
    owner_ranks = list(range(size - servers, size)) if servers else list(range(size))
    if grad_shard_bytes > 0:
        per = max(1, grad_shard_bytes // itemsize)
        count = max(1, -(-total // per))
    else:
        count = len(owner_ranks)
    count = max(1, min(count, total))
    bounds = [(total * k // count, total * (k + 1) // count) for k in range(count)]
    owners = [owner_ranks[k % len(owner_ranks)] for k in range(count)]
    return Layout(total, bounds, owners, size - servers, size)


class Shards:
    """The shards one rank owns: their parameters, optimizer state and update session
    (``make_session(graph) -> session``, the runtime's session factory, handed in)."""

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


@dataclass
class PSRuntime:
    """Everything a rank keeps for one PSPushPull node (in ``CommNode.state['ps']``)."""

    layout: Layout
    shards: Shards
    group: Any  # the kernel's duplicate of the group
    shapes: list[np.ndarray] = field(default_factory=list)  # empty arrays shaped like the params
    dtype: Any = np.float32
    stopped: bool = False
    lockstep: bool = False  # dedicated servers follow the program (DistributedSGD)

    @property
    def dedicated(self) -> bool:
        return self.layout.workers < self.layout.size


def split_inputs(node: CommNode, inputs: list[Any]) -> tuple[Any, Any, list, list, list[list]]:
    """(lr, t, params, grads, [state kind 0 params, ...]) of the node's inputs."""
    n = len(node.outputs)
    xs, gs, rest = inputs[2:2 + n], inputs[2 + n:2 + 2 * n], inputs[2 + 2 * n:]
    kinds = len(rest) // n if n else 0
    return inputs[0], inputs[1], xs, gs, [rest[i * n:(i + 1) * n] for i in range(kinds)]


def make_runtime(comm: Any, node: CommNode, xs: list[np.ndarray],
                 states: list[list[np.ndarray]], make_session: Any) -> PSRuntime:
    """Layout, private communicator (collective over all ranks) and this rank's shards."""
    servers = resolve_servers(int(node.attributes.get("servers", 0)), comm.size)
    flat_x = flatten(xs)
    layout = make_layout(flat_x.size, flat_x.itemsize, int(node.attributes.get(
        "grad_shard_bytes", 0)), comm.size, servers)
    group = private_group(comm, "ps", lambda g: g.dup("parameter-server set-up"))
    shards = Shards(layout, comm.rank, node.attributes["update"], make_session)
    shards.load(flat_x, [flatten(group) for group in states])
    logger.info("ps: rank %d owns shards %s of %d (%d worker(s), %d server(s))", comm.rank,
                shards.ids, len(layout.bounds), layout.workers, servers)
    return PSRuntime(layout, shards, group, [np.empty(np.shape(x), flat_x.dtype) for x in xs],
                     flat_x.dtype)


# --------------------------------------------------------------------------- one step

class Waiting(NamedTuple):
    """What a wait is for, as the timeout message names it (``comm.timeout_message``)."""

    op_type: str
    name: str


def role(rt: PSRuntime, rank: int) -> str:
    if rank >= rt.layout.workers:
        return f"parameter server rank {rank}"
    return f"worker rank {rank}" + (" (co-located shard owner)" if not rt.dedicated else "")


def send(rt: PSRuntime, node: Any, buf: np.ndarray, peer: int, tag: int, what: str) -> Any:
    """One message to ``peer``; its Work's errors say which shard or round, and who."""
    return rt.group.exchange([(buf, peer)], [], tag, Waiting(
        node.op_type, f"{node.name}: {what} {role(rt, peer)}"))


def recv(rt: PSRuntime, node: Any, buf: np.ndarray, peer: int, tag: int, what: str) -> Any:
    return rt.group.exchange([], [(buf, peer)], tag, Waiting(
        node.op_type, f"{node.name}: {what} {role(rt, peer)}"))


def recv_owner(rt: PSRuntime, node: Any, buf: np.ndarray, k: int, tag: int, what: str) -> Any:
    return recv(rt, node, buf, rt.layout.owners[k], tag, f"{what} of shard {k} from")


def owner_round(rt: PSRuntime, node: Any, me: int, own_grad: np.ndarray | None
                ) -> dict[int, list]:
    """Post the receives of every worker's slice of the shards this rank owns (``own_grad``:
    this rank's flat gradient when it is also a worker)."""
    lay = rt.layout
    recvs: dict[int, list[tuple[int, np.ndarray, Any]]] = {}
    for k in rt.shards.ids:
        lo, hi = lay.bounds[k]
        rows = []
        for w in range(lay.workers):
            if w == me and own_grad is not None:
                rows.append((w, own_grad[lo:hi], None))
            else:
                buf = np.empty(hi - lo, rt.dtype)
                rows.append((w, buf, recv(rt, node, buf, w, TAG_GRAD,
                                          f"gradient of shard {k} from")))
        recvs[k] = rows
    return recvs


def finish_owner_round(comm: Any, node: Any, rt: PSRuntime, recvs: dict, lr: float, t: int,
                        out: np.ndarray | None) -> list[Any]:
    """Sum the received slices in worker order, average, update, send the new slices out."""
    lay, me, sends = rt.layout, comm.rank, []
    for k, rows in recvs.items():
        acc = None
        for w, buf, work in rows:  # worker order: the same sum on any owner
            if work is not None:
                work.wait()
            acc = buf.copy() if acc is None else np.add(acc, buf, out=acc)
        if acc.dtype.kind == "f":
            acc /= acc.dtype.type(lay.workers)
        x_new = rt.shards.update(k, acc, lr, t)
        if out is not None:
            lo, hi = lay.bounds[k]
            out[lo:hi] = x_new
        for w in range(lay.workers):
            if w != me:
                sends.append(send(rt, node, x_new, w, TAG_PARAM, "delivery of a message to"))
                comm.bytes_sent += x_new.nbytes
    return sends


def header(rt: PSRuntime, node: Any, command: int, lr: float = 0.0, t: int = 0) -> list[Any]:
    """Worker -> every dedicated server: the round's command (and lr, t for a step)."""
    if not rt.dedicated:
        return []
    hdr = np.array([command, lr, t], np.float64)
    return [send(rt, node, hdr, s, TAG_HDR, "delivery of a message to")
            for s in rt.layout.servers]


def complete(works: list[Any]) -> None:
    for work in works:
        work.wait()


@register_kernel("PSPushPull")
def ps_push_pull(comm, node, inputs):
    lr_in, t_in, xs, gs, states = split_inputs(node, list(inputs))
    rt: PSRuntime | None = node.state.get("ps")
    if rt is None:
        raise CommError(f"ngdist.PSPushPull '{node.name}' ran before its parameter-server "
                        "set-up; the Trainer sets it up on every rank at start")
    lay, me = rt.layout, comm.rank
    lr, t = float(np.asarray(lr_in)), int(np.asarray(t_in))
    grad = flatten(gs)
    out = np.empty(lay.total, rt.dtype)
    sends = header(rt, node, STEP, lr, t)
    recvs = owner_round(rt, node, me, grad)
    if not rt.dedicated:  # co-located: the workers' parameters are the owners' (bit-identical)
        flat_x = flatten(xs)
        for k in rt.shards.ids:
            lo, hi = lay.bounds[k]
            rt.shards.x[k] = flat_x[lo:hi].copy()
    pulls = []
    for k, (lo, hi) in enumerate(lay.bounds):
        owner = lay.owners[k]
        if owner != me:
            pulls.append(recv_owner(rt, node, out[lo:hi], k, TAG_PARAM, "update"))
            sends.append(send(rt, node, grad[lo:hi], owner, TAG_GRAD,
                              "delivery of a message to"))
            comm.bytes_sent += (hi - lo) * grad.itemsize
    sends += finish_owner_round(comm, node, rt, recvs, lr, t, out)
    complete(pulls)
    complete(sends)
    return unflatten(out, rt.shapes)
