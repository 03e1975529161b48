"""Fuzz ngdist's model loading with mutations of real model files, on a large budget.

    python benchmarks/fuzz_models.py --cases 1000 --seed 1 [--timeout 120] [--memory-gib 4]
        [--kinds bitflip,external,...] [--keep DIR] [--json FILE]

The generator and the runner are tests/fuzz/modelfuzz.py (the CI test runs the same code on
about 100 cases): each case mutates a model file that ngdist wrote (bundled MLP/CNN: forward,
training, rewritten, saved) and runs ``ngdist inspect``, ``ngdist rewrite``, ``ngdist.compile``
plus one training step, and, when the rewrite wrote a file, compile + step on that file, in a
worker process under a timeout and ``RLIMIT_AS``. Printed: cases per class (ok, clean,
traceback, crash, hang, oom) and per mutation kind, then each bad case. Exit status 1 when any
case is a traceback, crash, hang or out-of-memory.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "fuzz")]

import modelfuzz  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=1000)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a case may take")
    p.add_argument("--memory-gib", type=float, default=4.0, help="RLIMIT_AS of the worker")
    p.add_argument("--kinds", help="comma-separated mutation kinds (default all): "
                   + ", ".join(modelfuzz.MUTATIONS))
    p.add_argument("--keep", type=Path, help="write the cases here and keep them")
    p.add_argument("--json", type=Path, help="also write the counts and bad cases as JSON")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",") if args.kinds else None
    unknown = sorted(set(kinds or []) - set(modelfuzz.MUTATIONS))
    if unknown:
        p.error(f"unknown kinds {unknown}; choose from {', '.join(modelfuzz.MUTATIONS)}")
    bar = tqdm(total=args.cases, unit="case")
    report = modelfuzz.fuzz(args.cases, args.seed, folder=args.keep, timeout=args.timeout,
                            memory_bytes=int(args.memory_gib * 2 ** 30), kinds=kinds,
                            progress=lambda i: bar.update())
    bar.close()
    print(f"{args.cases} cases, seed {args.seed}, {report.seconds:.0f} s\n")
    print(report.table())
    for line in report.failure_lines(limit=len(report.failures)):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({
            "cases": args.cases, "seed": args.seed, "seconds": report.seconds,
            "counts": dict(report.counts),
            "by_kind": {k: dict(v) for k, v in report.by_kind.items()},
            "bad": report.failure_lines(limit=len(report.failures))}, indent=1))
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
