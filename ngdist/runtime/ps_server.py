"""The parameter-server side of the ``ps`` strategy: set-up, the serve loop, checkpoints.

Every rank of a job runs the same program. With dedicated servers (the last ``K`` ranks) a
server rank must answer the workers' rounds instead of training. Two ways, both here:

* ``ngdist.compile`` calls ``setup(trainer)`` on every rank; on a server rank it serves until
  every worker has stopped (``Trainer.close`` or interpreter exit) and then returns the trainer
  in the ``server`` role: ``shard()`` yields nothing, so the usual
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
import functools
import logging
from typing import Any

import numpy as np
import onnxruntime as ort

from ngdist.errors import CommError, GraphError
from ngdist.kernels.base import CommNode, flatten, unflatten
from ngdist.kernels.ps import (COMMANDS, SAVE, STEP, STOP, TAG_FINAL, TAG_HDR, TAG_STATE,
                               PSRuntime, complete, env_servers, finish_owner_round, header,
                               make_runtime, owner_round, split_inputs, wait_owner,
                               wait_peer)

logger = logging.getLogger(__name__)


def ps_node(trainer: Any) -> CommNode | None:
    nodes = [n for n in trainer.executor.comm_nodes.values() if n.op_type == "PSPushPull"]
    if len(nodes) > 1:
        raise GraphError(f"a step graph may hold one ngdist.PSPushPull node, not {len(nodes)}")
    return nodes[0] if nodes else None


def runtime(trainer: Any) -> PSRuntime | None:
    node = ps_node(trainer)
    return None if node is None else node.state.get("ps")


def setup(trainer: Any, serve: bool = True) -> None:
    """On every rank, right after the Trainer: shards and owners (collective). On a dedicated
    server rank, with ``serve``, answer the workers until they all stop; without, the caller
    serves round by round (``serve_round``)."""
    node = ps_node(trainer)
    if node is None:
        if env_servers() > 0:
            raise GraphError(f"NGDIST_PS_SERVERS={env_servers()} (ngdist run --servers) asks "
                             "for dedicated parameter servers, but the strategy is not 'ps'")
        return
    values = {n: v.numpy() for n, v in trainer.values.items()}
    _, _, xs, _, states = split_inputs(node, node.inputs)
    rt = node.state["ps"] = make_runtime(trainer.comm, node, [values[x] for x in xs],
                                         [[values[s] for s in g] for g in states])
    rt.lockstep = not serve
    trainer.num_workers = rt.layout.workers
    if not rt.dedicated:
        return
    if trainer.comm.rank >= rt.layout.workers:
        trainer.role = "server"
        if serve:
            while serve_round(trainer) != STOP:
                pass
            rt.stopped = True
            return
    at_exit = functools.partial(stop, trainer)  # a rank that never calls close() still stops
    atexit.register(at_exit)
    trainer.close_hooks.append(lambda: (stop(trainer), atexit.unregister(at_exit)))


def serve_round(trainer: Any, expect: int | None = None) -> int:
    """One round on a dedicated server: wait for every worker's header, then do what it asks.
    Returns the command; raises if it is not ``expect`` (lockstep) or the workers disagree."""
    node, rt = ps_node(trainer), runtime(trainer)
    comm, lay = trainer.comm, rt.layout
    hdrs = [np.zeros(3, np.float64) for _ in range(lay.workers)]
    reqs = [rt.mpi.Irecv(h, source=w, tag=TAG_HDR) for w, h in enumerate(hdrs)]
    for w, req in enumerate(reqs):  # (a worker that idles longer than the timeout also ends here)
        wait_peer(comm, req, node, rt, w, f"server rank {comm.rank}: next request from")
    asked = [COMMANDS.get(int(h[0]), str(h[0])) for h in hdrs]
    if len(set(asked)) != 1 or (expect is not None and int(hdrs[0][0]) != expect):
        wanted = f", while this server is in {COMMANDS[expect]}()" if expect else ""
        raise CommError(f"parameter server rank {comm.rank}: the workers asked for {asked}"
                        f"{wanted}; every rank must call step, save_checkpoint and close "
                        "together")
    cmd = int(hdrs[0][0])
    if cmd == STEP:
        lr, t = float(hdrs[0][1]), int(hdrs[0][2])
        recvs = owner_round(rt, comm.rank, None)
        complete(comm, node, rt, finish_owner_round(comm, node, rt, recvs, lr, t, None))
    elif cmd == SAVE:
        complete(comm, node, rt, _send_states(rt))
    elif cmd == STOP:
        final = np.empty(lay.total, rt.dtype)
        wait_peer(comm, rt.mpi.Irecv(final, source=0, tag=TAG_FINAL), node, rt, 0,
                  "final parameters from")
        _, _, xs, _, _ = split_inputs(node, node.inputs)
        for name, arr in zip(xs, unflatten(final, rt.shapes)):
            trainer.values[name] = ort.OrtValue.ortvalue_from_numpy(np.array(arr))
        logger.info("ps: server rank %d: all workers stopped", comm.rank)
    return cmd


def stop(trainer: Any) -> None:
    """Once per rank: a worker tells every dedicated server that it is done (worker 0 also
    sends the final parameters); a lockstep server serves that last round."""
    rt = runtime(trainer)
    if rt is None or not rt.dedicated or rt.stopped:
        return
    rt.stopped = True
    node, comm = ps_node(trainer), trainer.comm
    if comm.rank >= rt.layout.workers:
        serve_round(trainer, expect=STOP)
        return
    sends = header(rt, STOP)
    if comm.rank == 0:
        _, _, xs, _, _ = split_inputs(node, node.inputs)
        final = flatten([trainer.values[x].numpy() for x in xs]).copy()
        sends += [(s, rt.mpi.Isend(final, dest=s, tag=TAG_FINAL)) for s in rt.layout.servers]
    complete(comm, node, rt, sends)


def _send_states(rt: PSRuntime) -> list[Any]:
    """Owner -> rank 0: the optimizer state of each owned shard (one buffer per shard)."""
    return [(0, rt.mpi.Isend(np.concatenate(rt.shards.state[k]) if rt.shards.kinds else
                             np.empty(0, rt.dtype), dest=0, tag=TAG_STATE))
            for k in rt.shards.ids]


def gather_state(trainer: Any) -> dict[str, np.ndarray] | None:
    """Collective over the workers (dedicated servers answer a ``save`` round): the owners'
    optimizer state as full arrays by name on rank 0; None elsewhere and without ps."""
    node, rt = ps_node(trainer), runtime(trainer)
    if rt is None:
        return None
    comm, lay = trainer.comm, rt.layout
    if comm.rank >= lay.workers:
        serve_round(trainer, expect=SAVE)
        return None
    sends = header(rt, SAVE)
    if comm.rank != 0:
        complete(comm, node, rt, sends + ([] if rt.dedicated else _send_states(rt)))
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
            pulls.append((k, buf, rt.mpi.Irecv(buf, source=lay.owners[k], tag=TAG_STATE)))
    for k, buf, req in pulls:
        wait_owner(comm, req, node, rt, k, "optimizer state")
        lo, hi = lay.bounds[k]
        for i in range(kinds):
            flat[i][lo:hi] = buf[i * (hi - lo):(i + 1) * (hi - lo)]
    complete(comm, node, rt, sends)
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
