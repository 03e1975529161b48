"""A sharded trainer's flat shards (passes/shard.py): each rank's shard of the full optimizer
state (ZeRO-1/2) and parameters (ZeRO-3) at start-up or on ``load_state_dict``, and the full
per-parameter tensors gathered for ``state_dict()``, ``parameters()`` and ``trainer.save``.
Where each tensor lies: the step's shard layout (ngdist/ir/shards.py).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
import onnx_ir as ir

from ngdist.errors import NgdistError
from ngdist.ir.domain import GRAD_SCALE, SHARD_RANK
from ngdist.ir.shards import Flat, flats, pack, pieces, rank_slice
from ngdist.ir.model import assemble_training_model

if TYPE_CHECKING:
    from ngdist.runtime.trainer import Trainer

logger = logging.getLogger(__name__)


def owners(plan: dict[str, Any]) -> list[str]:
    """``ngdist inspect --shard``: every bucket's shards, which rank owns each, and the
    parameter elements each holds (``name[a:b]`` of the flattened tensor)."""
    n, level = int(plan["ranks"]), plan["level"]
    held = "the parameters and of each optimizer state" if level == "parameters" else \
        "each optimizer state"
    per_rank = sum(int(g["size"]) for g in plan["groups"])
    out = [f"shards (shard={level} on {n} ranks): {len(plan['groups'])} bucket(s); each rank "
           f"owns {per_rank:,} elements of {held}"]
    for group in plan["groups"]:
        size, length = int(group["size"]), int(group["length"])
        name = next(iter(group["states"].values()), group.get("param", "")).rsplit(".", 1)[0]
        out.append(f"  bucket {name}: {length:,} elements, {size:,} per rank "
                   f"({size * n - length} padding)")
        starts = np.cumsum([0] + [int(p["count"]) for p in group["params"]])
        for r in range(n):
            lo, hi = r * size, (r + 1) * size
            parts = [f"{p['param']}[{max(lo, a) - a}:{min(hi, b) - a}]"
                     for p, a, b in zip(group["params"], starts[:-1], starts[1:])
                     if a < hi and b > lo]
            out.append(f"    rank {r}: {' '.join(parts) or '(padding only)'}")
    return out


class ShardedState:
    """Scatters and gathers the flat shards of one trainer."""

    def __init__(self, plan: dict[str, Any], plain_step: ir.Model | None) -> None:
        self.plan = plan
        self.ranks = int(plan["ranks"])
        self.level = str(plan["level"])
        # the training step as compiled from, for saved models; None for a file written by
        # ngdist rewrite --shard, which saves as such a file again
        self.plain_step = plain_step

    def flats(self, states: bool = True) -> Iterator[Flat]:
        """The flat inputs of this trainer (ngdist/ir/shards.py ``flats``)."""
        return flats(self.plan, states)

    @property
    def parameter_names(self) -> list[str]:
        """The per-parameter names of the ZeRO-3 shards (none below ZeRO-3)."""
        return [n for _, _, names in self.flats(states=False) for n in names]

    def slices(self, full: Mapping[str, Any], rank: int,
               dtype: Callable[[str], Any]) -> dict[str, np.ndarray]:
        """Rank ``rank``'s ``[1, S]`` slice of every flat input (of element type
        ``dtype(name)``) whose tensors ``full`` (arrays, or onnx_ir tensors) holds (all or none
        of a bucket's; a missing state starts at zero), none of them made whole."""
        out = {}
        for name, group, names in self.flats():
            if not any(n in full for n in names):
                if name.endswith(".param"):
                    raise NgdistError(f"no values for the parameters {names} of shard {name}")
                continue
            out[name] = rank_slice(group, names, full, dtype(name), self.ranks, rank)
        return out

    def attach(self, trainer: Trainer, slices: Mapping[str, np.ndarray]) -> None:
        """Sets the rank and this rank's ``slices`` (of :meth:`slices`) of the flat inputs."""
        if trainer.group.size != self.ranks:
            raise NgdistError(f"the step graph is sharded for {self.ranks} ranks but this job "
                              f"has {trainer.group.size}; compile it in this job")
        dtype = trainer.values[SHARD_RANK].numpy().dtype
        trainer.values[SHARD_RANK] = trainer.placement.value(
            np.array([trainer.group.rank], dtype))
        trainer.sharding = self
        for name, value in slices.items():
            trainer.values[name] = trainer.placement.value(value)

    def load(self, trainer: Trainer, full: Mapping[str, np.ndarray]) -> None:
        """This rank's slice of every flat input whose tensors ``full`` holds (all or none of
        a bucket's; a missing state starts at zero)."""
        mine = self.slices(full, trainer.group.rank, lambda n: trainer.values[n].numpy().dtype)
        for name, value in mine.items():
            trainer.values[name] = trainer.placement.value(value)  # [1, S]: ngdist/ir/shards.py

    def gather(self, trainer: Trainer, chosen: Iterable[Flat]) -> dict[str, np.ndarray]:
        """Collective: every per-parameter tensor of ``chosen`` (of ``self.flats``), whole, on
        every rank."""
        out: dict[str, np.ndarray] = {}
        for name, group, names in chosen:
            size = int(group["size"])
            mine = np.ascontiguousarray(trainer.values[name].numpy().reshape(-1))
            whole = np.empty(size * self.ranks, mine.dtype)
            trainer.group.allgather(mine, whole, f"gather {name}").wait()
            out.update(pieces(whole, group, names))
        return out

    def expand(self, trainer: Trainer, values: dict[str, np.ndarray], states: bool = False
               ) -> dict[str, np.ndarray]:
        """``values`` (by input name) with the flat inputs replaced by the gathered
        per-parameter tensors: the parameters' (ZeRO-3; collective there) and with ``states``
        the optimizer state's (collective)."""
        chosen = [f for f in self.flats(states) if f[0] in values]
        out = {n: v for n, v in values.items() if n != SHARD_RANK}
        for name, _, _ in chosen:
            del out[name]
        out.update(self.gather(trainer, chosen))
        return out

    def full_state(self, trainer: Trainer) -> dict[str, np.ndarray]:
        """Collective: ``trainer.state_dict()``: every per-parameter tensor whole."""
        values = {n: v.numpy().copy() for n, v in trainer.values.items() if n != GRAD_SCALE}
        return self.expand(trainer, values, states=True)

    def whole_names(self) -> set[str]:
        """The per-parameter tensors the flat inputs hold."""
        return {n for _, _, names in self.flats() for n in names}

    def load_state(self, trainer: Trainer, state: Mapping[str, np.ndarray]) -> None:
        """``trainer.load_state_dict`` of full tensors (names checked by the caller): each
        rank takes its slices."""
        flat = self.whole_names()
        for n, v in state.items():
            if n not in flat:
                trainer.values[n] = trainer.placement.value(
                    np.array(v, dtype=trainer.values[n].numpy().dtype))
        self.load(trainer, state)

    def full_model(self, trainer: Trainer) -> onnx.ModelProto:
        """Collective: the standard training model with the current values: the step as it
        was compiled from (optimizer node, no comm), so it resumes under any strategy; from a
        sharded file (``ngdist rewrite --shard``), such a file with the current values."""
        values = self.expand(trainer, trainer._deployable(), states=True)
        logger.info("sharded state gathered: %d tensors", len(values))
        if self.plain_step is not None:
            return assemble_training_model(trainer.inference, self.plain_step, values)
        model = assemble_training_model(trainer.inference, trainer.step_model, values)
        pack(model, self.plan, values)
        return model
