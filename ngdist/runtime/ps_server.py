"""The parameter-server side of the ``ps`` strategy: set-up, the serve loop, checkpoints.

Every rank of a job runs the same program. With dedicated servers (the last ``K`` ranks) a
server rank must answer the workers' rounds instead of training. Two ways, both here:

* the Trainer calls ``attach(trainer)`` on every rank, which returns the rank's
  :class:`Role`; a :class:`ParameterServer` serves, once the trainer has started it, until
  every worker has stopped (``Trainer.close`` or interpreter exit), and the trainer stays in
  the ``server`` role: ``shard()`` yields nothing, so the usual
  ``for batch in trainer.shard(...)`` loop is empty there, and the trainer holds the final
  parameters (sent by worker 0 when it stops), so ``predict``/evaluation code still runs.
* ``DistributedSGD`` (Ray's API, whose step takes no batch) runs servers in *lockstep*: a
  server rank's ``step()``, ``save_checkpoint()`` and ``close()`` each serve the matching
  round (``serve_round``), so one script with several sessions runs unchanged on all ranks.

Checkpoints: ``gather_state`` collects the owners' optimizer state at rank 0 (a ``save``
round for servers); ``load_state`` makes every owner re-read its shards from its trainer's
values (after ``load_state_dict``), which in lockstep every rank, servers included, holds.
"""
from __future__ import annotations

import atexit
import logging
from typing import Any

import numpy as np
import onnx

from ngdist.errors import CommError, GraphError, NgdistError
from ngdist.ir.model import IR_VERSION
from ngdist.kernels.base import CommNode, flatten, unflatten
from ngdist.kernels.ps import (COMMANDS, PS_REDUCTION, SAVE, STEP, STOP, TAG_FINAL, TAG_HDR,
                               TAG_STATE, PSRuntime, complete, env_servers, finish_owner_round,
                               header, make_runtime, owner_round, recv, recv_owner,
                               resolve_servers, runtime_of, send, split_inputs)
from ngdist.runtime.sessions import CPU, make_session

logger = logging.getLogger(__name__)


def ps_node(trainer: Any) -> CommNode | None:
    nodes = [n for n in trainer.executor.comm_nodes.values() if n.op_type == "PSPushPull"]
    if len(nodes) > 1:
        raise GraphError(f"a step graph may hold one ngdist.PSPushPull node, not {len(nodes)}")
    return nodes[0] if nodes else None


def planned_workers(trainer: Any) -> int:
    """The ranks that will train (all but the dedicated servers), known before ``attach``."""
    node = ps_node(trainer)
    if node is None:
        return trainer.group.size
    return trainer.group.size - resolve_servers(int(node.attributes["servers"]),
                                                trainer.group.size)


def runtime(trainer: Any) -> PSRuntime | None:
    node = ps_node(trainer)
    return None if node is None else runtime_of(node)


class Role:
    """This rank's part in training, set up when the Trainer starts (``attach``): a worker,
    which trains on ``workers`` ranks in all. ``start`` runs once the trainer is ready,
    ``close`` when it closes; ``refuse_step`` raises where the rank takes no steps."""

    name = "worker"

    def __init__(self, workers: int) -> None:
        self.workers = workers  # the ranks that train

    def start(self) -> None:
        """Nothing more to do: the rank trains."""

    def refuse_step(self) -> None:
        """A worker takes steps."""

    def close(self) -> None:
        """Nothing to end."""


class PSWorker(Role):
    """A worker of ``ps`` with dedicated servers: it stops them when it closes, or when the
    interpreter exits without ``close`` (worker 0 sends them the final parameters)."""

    def __init__(self, trainer: Any, workers: int) -> None:
        super().__init__(workers)
        self.trainer = trainer
        atexit.register(self._at_exit)

    def _at_exit(self) -> None:
        stop(self.trainer)

    def close(self) -> None:
        stop(self.trainer)
        atexit.unregister(self._at_exit)


class ParameterServer(Role):
    """A dedicated parameter-server rank (the last ranks of ``ps`` with ``servers``): it
    answers the workers' rounds instead of training. ``start`` serves until every worker has
    stopped, then the trainer holds the final parameters (``predict``/evaluation code still
    runs); in ``lockstep`` (``DistributedSGD``) the program serves round by round instead."""

    name = "server"

    def __init__(self, trainer: Any, workers: int, lockstep: bool) -> None:
        super().__init__(workers)
        self.trainer = trainer
        self.lockstep = lockstep

    def start(self) -> None:
        if not self.lockstep:
            self.serve()

    def serve(self) -> None:
        """Answers the workers' rounds until they all stop."""
        while serve_round(self.trainer) != STOP:
            pass
        runtime(self.trainer).stopped = True

    def refuse_step(self) -> None:
        raise NgdistError(f"rank {self.trainer.rank} is a dedicated parameter server: it has "
                          "served the workers' steps and takes none itself; iterate over "
                          "trainer.shard(...) (empty here) or skip step() on server ranks")

    def close(self) -> None:
        if self.lockstep:  # the last round: the workers' stop
            stop(self.trainer)


def _update_session(graph: onnx.GraphProto, opset: int) -> Any:
    """The shard update's session, from the runtime's one session factory (one thread)."""
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)],
                                   ir_version=IR_VERSION)
    return make_session(model, CPU, 1)


def attach(trainer: Any, serve: bool = True) -> Role:
    """On every rank, when the Trainer starts: shards and owners (collective) with a PSPushPull
    node, and this rank's role. A dedicated server with ``serve`` answers the workers until
    they all stop when the trainer starts it; without, the caller serves round by round
    (``serve_round``)."""
    node = ps_node(trainer)
    if node is None:
        if env_servers() > 0:
            raise GraphError(f"NGDIST_PS_SERVERS={env_servers()} (ngdist run --servers) asks "
                             "for dedicated parameter servers, but the strategy is not 'ps'")
        return Role(trainer.group.size)
    values = {n: v.numpy() for n, v in trainer.values.items()}
    _, _, xs, _, states = split_inputs(node, node.inputs)
    rt = make_runtime(trainer.group, node, [values[x] for x in xs],
                      [[values[s] for s in g] for g in states], _update_session)
    rt.lockstep = not serve
    workers = rt.layout.workers
    if not rt.dedicated:
        return Role(workers)
    if trainer.group.rank >= workers:
        return ParameterServer(trainer, workers, lockstep=not serve)
    return PSWorker(trainer, workers)


def serve_round(trainer: Any, expect: int | None = None) -> int:
    """One round on a dedicated server: wait for every worker's header, then do what it asks.
    Returns the command; raises if it is not ``expect`` (lockstep) or the workers disagree."""
    node, rt = ps_node(trainer), runtime(trainer)
    comm, lay = trainer.group, rt.layout
    hdrs = [np.zeros(3, np.float64) for _ in range(lay.workers)]
    works = [recv(rt, node, h, w, TAG_HDR, f"server rank {comm.rank}: next request from")
             for w, h in enumerate(hdrs)]
    complete(works)  # (a worker that idles longer than the timeout also ends here)
    asked = [COMMANDS.get(int(h[0]), str(h[0])) for h in hdrs]
    if len(set(asked)) != 1 or (expect is not None and int(hdrs[0][0]) != expect):
        wanted = f", while this server is in {COMMANDS[expect]}()" if expect else ""
        raise CommError(f"parameter server rank {comm.rank}: the workers asked for {asked}"
                        f"{wanted}; every rank must call step, save_checkpoint and close "
                        "together")
    cmd = int(hdrs[0][0])
    if cmd == STEP:
        lr, t = float(hdrs[0][1]), int(hdrs[0][2])
        recvs = owner_round(rt, node, rt.shards.x)  # the owned slices shape the receives
        complete(finish_owner_round(comm, node, rt, recvs, rt.shards.updater(lr, t), None,
                                    PS_REDUCTION))
    elif cmd == SAVE:
        complete(_send_states(rt, node))
    elif cmd == STOP:
        final = np.empty(lay.total, rt.dtype)
        recv(rt, node, final, 0, TAG_FINAL, "final parameters from").wait()
        _, _, xs, _, _ = split_inputs(node, node.inputs)
        trainer.load_state_dict(dict(zip(xs, unflatten(final, rt.shapes))))
        logger.info("ps: server rank %d: all workers stopped", comm.rank)
    return cmd


def stop(trainer: Any) -> None:
    """Once per rank: a worker tells every dedicated server that it is done (worker 0 also
    sends the final parameters); a lockstep server serves that last round."""
    rt = runtime(trainer)
    if rt is None or not rt.dedicated or rt.stopped:
        return
    rt.stopped = True
    node, comm = ps_node(trainer), trainer.group
    if comm.rank >= rt.layout.workers:
        serve_round(trainer, expect=STOP)
        return
    sends = header(rt, node, STOP)
    if comm.rank == 0:
        _, _, xs, _, _ = split_inputs(node, node.inputs)
        final = flatten([trainer.values[x].numpy() for x in xs])
        sends += [send(rt, node, final, s, TAG_FINAL, "delivery of a message to")
                  for s in rt.layout.servers]
    complete(sends)


def _send_states(rt: PSRuntime, node: Any) -> list[Any]:
    """Owner -> rank 0: the optimizer state of each owned shard (one buffer per shard)."""
    return [send(rt, node, np.concatenate(rt.shards.state[k]) if rt.shards.kinds else
                 np.empty(0, rt.dtype), 0, TAG_STATE, "delivery of a message to")
            for k in rt.shards.ids]


def gather_state(trainer: Any) -> dict[str, np.ndarray] | None:
    """Collective over the workers (dedicated servers answer a ``save`` round): the owners'
    optimizer state as full arrays by name on rank 0; None elsewhere and without ps."""
    node, rt = ps_node(trainer), runtime(trainer)
    if rt is None:
        return None
    comm, lay = trainer.group, rt.layout
    if comm.rank >= lay.workers:
        serve_round(trainer, expect=SAVE)
        return None
    sends = header(rt, node, SAVE)
    if comm.rank != 0:
        complete(sends + ([] if rt.dedicated else _send_states(rt, node)))
        return None
    kinds = rt.shards.kinds
    flat = [np.empty(lay.total, rt.dtype) for _ in range(kinds)]
    pulls = []
    for k, (lo, hi) in enumerate(lay.bounds):
        if lay.owners[k] == 0:
            for i in range(kinds):
                flat[i][lo:hi] = rt.shards.state[k][i]
        else:
            buf = np.empty(kinds * (hi - lo), rt.dtype)
            pulls.append((k, buf, recv_owner(rt, node, buf, k, TAG_STATE, "optimizer state")))
    for k, buf, work in pulls:
        work.wait()
        lo, hi = lay.bounds[k]
        for i in range(kinds):
            flat[i][lo:hi] = buf[i * (hi - lo):(i + 1) * (hi - lo)]
    complete(sends)
    _, _, _, _, states = split_inputs(node, node.inputs)
    out: dict[str, np.ndarray] = {}
    for i, names in enumerate(states):
        out.update(zip(names, (a.copy() for a in unflatten(flat[i], rt.shapes))))
    return out


def load_state(trainer: Any, with_state: bool = True) -> None:
    """Every owner re-reads its shards' parameters (and, with ``with_state``, optimizer state)
    from its trainer's values, e.g. after ``load_state_dict`` of a checkpoint. Local; under
    dedicated servers every rank must hold the values, as in DistributedSGD's lockstep."""
    node, rt = ps_node(trainer), runtime(trainer)
    if rt is None:
        return
    if rt.dedicated and not rt.lockstep:
        raise CommError("restoring parameter-server state needs the servers in lockstep "
                        "(ngdist.DistributedSGD); with ngdist.compile they are serving")
    _, _, xs, _, states = split_inputs(node, node.inputs)
    flat_x = flatten([trainer.values[x].numpy() for x in xs])
    flat_s = [flatten([trainer.values[s].numpy() for s in g]) for g in states]
    rt.shards.load(flat_x, flat_s if with_state else None)
