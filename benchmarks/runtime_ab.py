"""Same-run A/B of the runtime: this checkout against the code before the step plan.

    python benchmarks/runtime_ab.py [--before REV] [--after REV] [--rounds 2]
        [--only comm mlp cnn zoo] [--out DIR] [--smoke]

``--before`` defaults to the commit before the one that added ``ngdist/runtime/plan.py`` (the
step plan), found in ``git log``; ``--after`` to this checkout as it is (with ``REV``: that
commit's tree). A commit's tree is exported with ``git archive`` into a temporary
folder (the repository is only read), and each benchmark runs from both trees with this
venv's interpreter, ``PYTHONPATH`` set to the tree (checked: the ``ngdist`` each run imports
is that tree's). The two codes alternate benchmark by benchmark, the first of each pair
switching every round, ``--rounds`` times:

* ``comm``: ``benchmarks/step_comm_cost.py --ranks 2 --sizes 4 16 64``: the comm in a step
  (allreduce step - local step, ms) and raw mpi4py Allreduce of the same bytes;
* ``mlp``, ``cnn``: ``benchmarks/mlp_allreduce.py`` / ``cnn_allreduce.py --ranks 1 2``:
  ngdist steps/s and ngdist / PyTorch (eager on 1 rank, DDP on 2) in the same run;
* ``zoo``: ``benchmarks/model_zoo.py`` (transformers and CNNs against eager torch, AdamW):
  the median ratio ngdist / torch.

It prints one table per benchmark, the codes side by side, run by run, and keeps every
run's full output in ``--out`` (default: a new temporary folder, named at the end).
``--smoke`` runs each benchmark at a tiny size, once per code (a check that the A/B works,
not a measurement). Run it on a quiet machine: docs/benchmarks.md ("The runtime as a step
plan") shows how far a loaded one moves these numbers between neighbouring runs.
Where the machine cannot be made quiet, ``--realtime`` runs every benchmark (its ranks,
threads and the PyTorch side alike) under ``SCHED_FIFO`` at the lowest real-time priority
(``chrt --fifo 1``, needs root): background work then gets the cores only when the benchmark
leaves them or Linux's real-time throttle (``sched_rt_runtime_us``, 5% of each second by
default) gives them back. Without it, a rank waiting for its peer yields its core
(``sched_yield``) and the scheduler hands it to the background work for a whole time slice,
however low that work's priority: 2-rank steps then take 2-3x longer.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLAN = "ngdist/runtime/plan.py"

# benchmark -> (script, arguments, smoke arguments)
BENCHES = {
    "comm": ("step_comm_cost.py", ["--ranks", "2", "--sizes", "4", "16", "64", "--rounds", "3"],
             ["--ranks", "2", "--sizes", "1", "--rounds", "1", "--steps", "3"]),
    "mlp": ("mlp_allreduce.py", ["--ranks", "1", "2", "--steps", "60", "--warmup", "10",
                                 "--repeats", "1"],
            ["--ranks", "1", "2", "--steps", "3", "--warmup", "1", "--repeats", "1"]),
    "cnn": ("cnn_allreduce.py", ["--ranks", "1", "2", "--steps", "60", "--warmup", "10",
                                 "--repeats", "1"],
            ["--ranks", "1", "2", "--steps", "3", "--warmup", "1", "--repeats", "1"]),
    "zoo": ("model_zoo.py", ["--rounds", "3"],
            ["--models", "bert", "resnet", "--width", "32", "--layers", "1", "--batch", "2",
             "--length", "8", "--images", "2", "--steps", "1", "--warmup", "1",
             "--rounds", "1"]),
}


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], check=True, capture_output=True,
                          text=True).stdout.strip()


def before_plan() -> str:
    """The commit before the one that added the step plan."""
    added = git("log", "--diff-filter=A", "--format=%H", "--", PLAN).splitlines()
    if not added:
        sys.exit(f"no commit adds {PLAN} in this repository's history; pass --before REV")
    return git("rev-parse", f"{added[-1]}~1")


def export(rev: str, into: Path, name: str) -> Path:
    """The tree of ``rev`` as files under ``into`` (``git archive``: the repository is only
    read, no worktree is registered)."""
    tar = into / f"{name}.tar"
    with open(tar, "wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], check=True,
                       stdout=f)
    tree = into / name
    with tarfile.open(tar) as t:
        t.extractall(tree, filter="data")
    tar.unlink()
    return tree


REALTIME = ["chrt", "--fifo", "1"]  # --realtime: SCHED_FIFO, the lowest real-time priority


def run(tree: Path, bench: str, smoke: bool, realtime: bool = False) -> str:
    """One run of ``bench`` from ``tree``: its standard output (raises with its output when
    it fails, or when the ngdist it would import is not the tree's)."""
    script, args, small = BENCHES[bench]
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    where = subprocess.run([sys.executable, "-c", "import ngdist; print(ngdist.__file__)"],
                           env=env, cwd=tree, capture_output=True, text=True, check=True)
    if not Path(where.stdout.strip()).resolve().is_relative_to(tree.resolve()):
        sys.exit(f"the run from {tree} would import ngdist from {where.stdout.strip()}")
    proc = subprocess.run([*(REALTIME if realtime else []), sys.executable,
                           str(tree / "benchmarks" / script),
                           *(small if smoke else args)], env=env, cwd=tree,
                          capture_output=True, text=True, timeout=3600)
    if proc.returncode:
        sys.exit(f"{script} from {tree} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
    return proc.stdout


def numbers(bench: str, out: str) -> dict[str, str]:
    """The figures of one run, by row label: comm in step (mpi4py) per size; steps/s
    (ngdist / PyTorch) per rank count; the zoo's median ratios."""
    rows: dict[str, str] = {}
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if bench == "comm" and re.fullmatch(r"\d+ MiB", cells[0]) and len(cells) > 5:
            rows[cells[0]] = f"{cells[3].removesuffix(' ms')} ({cells[5].removesuffix(' ms')})"
        elif bench in ("mlp", "cnn") and cells[0].isdigit() and len(cells) > 4:
            rows[f"{cells[0]} rank(s)"] = f"{cells[1]} ({cells[4]})"
        elif bench == "zoo" and line.startswith("median"):
            label, value = line.rsplit(None, 1)
            rows[label.strip()] = value
    return rows


HEADS = {"comm": "comm in step, ms (mpi4py Allreduce of the same bytes)",
         "mlp": "ngdist steps/s (ngdist / PyTorch)", "cnn": "ngdist steps/s (ngdist / PyTorch)",
         "zoo": "ngdist / torch step time, median"}


def table(bench: str, runs: list[tuple[str, int, dict[str, str]]]) -> str:
    """Markdown: one row per figure, one column per run (code, round)."""
    labels = list(dict.fromkeys(k for _, _, r in runs for k in r))
    head = "| " + HEADS[bench] + " | " + " | ".join(f"{c}, run {i + 1}" for c, i, _ in runs)
    lines = [head + " |", "|---|" + "---:|" * len(runs)]
    for label in labels:
        lines.append(f"| {label} | " + " | ".join(r.get(label, "-") for _, _, r in runs) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", help="the code before (default: the commit before the step plan)")
    p.add_argument("--after", help="the code after (default: this checkout as it is)")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each code")
    p.add_argument("--only", nargs="+", choices=list(BENCHES), default=list(BENCHES))
    p.add_argument("--out", type=Path, help="folder for every run's output")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, one round: a check")
    p.add_argument("--realtime", action="store_true",
                   help="run every benchmark under SCHED_FIFO (chrt --fifo 1; root): other "
                        "work on the machine no longer takes the ranks' cores")
    args = p.parse_args()
    rev = git("rev-parse", args.before or before_plan())
    rounds = 1 if args.smoke else args.rounds
    out = args.out or Path(tempfile.mkdtemp(prefix="ngdist-ab-"))
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ngdist-before-") as tmp:
        trees = {"before": export(rev, Path(tmp), "before"),
                 "after": export(git("rev-parse", args.after), Path(tmp), "after")
                 if args.after else ROOT}
        dirty = git("status", "--porcelain", "--untracked-files=no")
        after = f"{args.after} (exported)" if args.after else \
            f"{ROOT} at {git('rev-parse', 'HEAD')[:12]}" + \
            (" with uncommitted changes" if dirty else "")
        print(f"before: {rev[:12]} (exported); after: {after}", flush=True)
        for bench in args.only:
            runs = []
            for i in range(rounds):
                for code in (("before", "after") if i % 2 == 0 else ("after", "before")):
                    text = run(trees[code], bench, args.smoke, args.realtime)
                    (out / f"{bench}-{code}-{i + 1}.txt").write_text(text)
                    runs.append((code, i, numbers(bench, text)))
            runs.sort(key=lambda r: (r[1], r[0] != "before"))
            print(f"\n{BENCHES[bench][0]} {' '.join(BENCHES[bench][2 if args.smoke else 1])}\n"
                  f"{table(bench, runs)}", flush=True)
    print(f"\nevery run's output: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
