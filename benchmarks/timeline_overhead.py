"""What the timeline costs: training steps/s with it off, on, and with its hooks absent.

    python benchmarks/timeline_overhead.py [--ranks 2] [--steps 100] [--rounds 7]
        [--sizes 64 256 256 10] [--batch 32] [--overlap 0|1]

Run plainly, it launches itself under the venv's mpiexec. Every rank builds three trainers of
the same digits MLP (allreduce, SGD with momentum, one onnxruntime thread per rank):

* ``off``: the shipped runtime without a timeline (every hook is one ``is None`` check);
* ``on``: the same with ``timeline=`` (every span recorded; the file is written at the end,
  outside the timed steps);
* ``absent``: the Trainer and the runtime's timer (runtime/timing.py, which the executor and
  the comm runner time everything with) with the hooks taken out of their source: the
  modules' source is parsed, every ``if timeline is not None:`` block and ``timeline =
  self.timeline`` read is removed from the syntax tree, and the result is compiled as a module
  of its own.

The trainers take turns, ``--steps`` steps each per round (the order rotates every round),
and the slowest rank's time of a turn gives its steps/s; each trainer keeps its best round.
It prints the steps/s and the ratios on/off and off/absent (1.00: no measurable cost).
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("off", "on", "absent")


class _StripHooks(ast.NodeTransformer):
    """Removes ``if timeline is not None: ...`` and ``timeline = self.timeline``."""

    def visit_If(self, node: ast.If):  # noqa: N802 - ast's naming
        test = node.test
        if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and \
                test.left.id == "timeline" and isinstance(test.ops[0], ast.IsNot):
            return node.orelse or None
        return self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign):  # noqa: N802
        value = node.value
        if isinstance(value, ast.Attribute) and value.attr == "timeline" and \
                isinstance(value.value, ast.Name) and value.value.id == "self" and \
                all(isinstance(t, ast.Name) and t.id == "timeline" for t in node.targets):
            return None
        return node


def _without_hooks(name: str, hooked: tuple[str, ...], **replace: object) -> types.ModuleType:
    """Module ``name`` compiled again from its source with the timeline hooks removed (none
    may be left in the functions ``hooked``); ``replace``: names of its namespace to rebind
    (e.g. the hook-free Executor)."""
    source = importlib.util.find_spec(name).origin
    tree = _StripHooks().visit(ast.parse(Path(source).read_text()))
    ast.fix_missing_locations(tree)
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef) and fn.name in hooked:
            left = [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Name) and
                    n.id == "timeline"]
            if left:
                raise RuntimeError(f"{name}.{fn.name} still reads the timeline (lines {left})")
    module = types.ModuleType(f"{name}_without_timeline_hooks")
    module.__file__ = source
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(tree, source, "exec"), module.__dict__)  # noqa: S102
    module.__dict__.update(replace)
    return module


def _trainer(variant: str, sizes: tuple[int, ...], overlap: bool | None, trace: str):
    import ngdist
    from ngdist import api, zoo

    kw = dict(optimizer=ngdist.optim.SGD(lr=0.01, momentum=0.9), intra_op_threads=1,
              overlap=overlap, timeline=trace if variant == "on" else False)
    if variant != "absent":
        return ngdist.compile(zoo.mlp(sizes, seed=0), **kw)
    # the runtime's one timer (runtime/timing.py) without its record, and every module that
    # uses it rebuilt around that one, down to the Trainer
    timing = _without_hooks("ngdist.runtime.timing", ("span",))
    comm_runner = _without_hooks("ngdist.runtime.comm_runner", (), span=timing.span)
    executor = _without_hooks("ngdist.runtime.executor", ("run",), span=timing.span,
                              CommRunner=comm_runner.CommRunner)
    step_executor = _without_hooks("ngdist.runtime.step_executor", (),
                                   Executor=executor.Executor)
    trainer = _without_hooks("ngdist.runtime.trainer", ("step", "shard"),
                             make_executor=step_executor.make_executor)
    shipped = api.Trainer
    api.Trainer = trainer.Trainer
    try:
        tr = ngdist.compile(zoo.mlp(sizes, seed=0), **kw)
    finally:
        api.Trainer = shipped
    assert type(tr.executor) is executor.Executor, "the hook-free executor runs the steps"
    return tr


def worker(args: argparse.Namespace) -> None:
    from ngdist.data import load_digits

    overlap = None if args.overlap is None else bool(args.overlap)
    trace = str(Path(args.out, "trace.json"))
    trainers = {v: _trainer(v, tuple(args.sizes), overlap, trace) for v in VARIANTS}
    group = trainers["off"].group
    x, y, _, _ = load_digits(test_fraction=0.0)
    rng = np.random.default_rng(0)
    g = args.batch * group.size
    feeds = []
    for _ in range(args.steps):
        idx = rng.integers(0, len(x), g)  # the same global batch on every rank
        sl = slice(group.rank * args.batch, (group.rank + 1) * args.batch)
        feeds.append({"x": np.ascontiguousarray(x[idx][sl]),
                      "y": np.ascontiguousarray(y[idx][sl])})
    for tr in trainers.values():  # warm-up: sessions built, buffers allocated
        for f in feeds[:5]:
            tr.step(f)
    best = dict.fromkeys(VARIANTS, 0.0)
    for r in range(args.rounds):
        for v in VARIANTS[r % 3:] + VARIANTS[:r % 3]:
            tr = trainers[v]
            group.barrier("benchmark turn").wait()
            t0 = time.perf_counter()
            for f in feeds:
                tr.step(f, fetch_stats=False)
            slowest = np.array([time.perf_counter() - t0])
            group.allreduce(slowest, "benchmark: slowest rank", op="max").wait()
            best[v] = max(best[v], args.steps / float(slowest[0]))
    for tr in trainers.values():
        tr.close()
    if group.rank == 0:
        events = len(json.loads(Path(trace).read_text())["traceEvents"])
        Path(args.out, "result.json").write_text(json.dumps({"best": best, "events": events}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=100, help="timed steps per turn")
    p.add_argument("--rounds", type=int, default=7, help="turns of each trainer; best kept")
    p.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 256, 10])
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--overlap", type=int, choices=[0, 1],
                   help="force the comm thread off/on (default: ngdist's choice)")
    p.add_argument("--out", help=argparse.SUPPRESS)  # given: this is a rank of the run
    args = p.parse_args()
    if args.out is not None:
        return worker(args)
    from ngdist.comm.launch import mpiexec_cmd

    with tempfile.TemporaryDirectory() as out:  # the ranks get these very options
        cmd = [*mpiexec_cmd(args.ranks), sys.executable, __file__, *sys.argv[1:], "--out", out]
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        env.pop("NGDIST_TIMELINE", None)
        subprocess.run(cmd, check=True, env=env, timeout=3600)
        result = json.loads(Path(out, "result.json").read_text())
    best = result["best"]
    print(f"MLP {'-'.join(map(str, args.sizes))}, {args.ranks} rank(s), batch {args.batch}/rank, "
          f"{args.steps} steps per turn, best of {args.rounds} alternating turns; "
          f"{result['events']} events in the trace")
    print("| timeline | steps/s |")
    print("|---|---|")
    for v in VARIANTS:
        print(f"| {v} | {best[v]:.1f} |")
    print(f"on / off: {best['on'] / best['off']:.3f}  (the cost of recording)")
    print(f"off / absent: {best['off'] / best['absent']:.3f}  (the cost of the hooks when off)")


if __name__ == "__main__":
    main()
