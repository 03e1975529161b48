"""The launch of the benchmarks that run themselves on N ranks: the shared command line
(``--ranks``, ``--batch``, ``--steps``, ``--rounds``) and the relaunch under the venv's mpiexec
with ``--worker --out FILE``; rank 0 writes its results to FILE as JSON (a fresh temporary
folder, which a worker may also use for its own files)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def parser(doc: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--steps", type=int, default=50, help="timed steps per block")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    return p


def run_workers(script: str, args: argparse.Namespace) -> Any:
    """``script --worker`` on ``args.ranks`` ranks; the results rank 0 wrote."""
    from ngdist.comm.launch import mpiexec_cmd

    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "results.json")
        env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        cmd = [*mpiexec_cmd(args.ranks), sys.executable, script, "--worker", "--out", out,
               "--batch", str(args.batch), "--steps", str(args.steps),
               "--rounds", str(args.rounds)]
        subprocess.run(cmd, check=True, env=env, timeout=3600)
        return json.loads(Path(out).read_text())
