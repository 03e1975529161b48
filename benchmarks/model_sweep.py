"""The model sweep: torchvision, timm and Hugging Face models (random init, tiny configs,
nothing downloaded) trained through ``ngdist.compile`` with the torch frontend and checked
against torch (benchmarks/sweep_check.py: export, one-step gradients against float64, 3 steps
of SGD and of AdamW, the step time against eager torch, one thread each).

Every model runs in a subprocess of its own with a time limit, so one hang or crash does not
stop the sweep. Results merge into ``docs/model_sweep.json`` (by case name: a run of some
models updates their rows) and the table between the sweep markers of docs/benchmarks.md is
regenerated from it.

    python benchmarks/model_sweep.py [--source torchvision timm transformers]
        [--only NAME ...] [--json FILE] [--merge FILE ...] [--failed] [--skip-done]
        [--limit N] [--timeout 600] [--memory 8] [--jobs 1] [--all-constructors] [--list]
        [--no-docs] [--report]

``--only`` takes case names (``tv/resnet18``, ``timm/resnet10t``, ``hf/causal/llama``: that
case alone, not ``llama4``) or prefixes ending in ``/`` (``hf/causal/``); a torchvision or timm
model the catalogue does not hold (``timm/resnet50d``: not its family's smallest) runs as its own
family (give it a ``--json`` of its own); ``--failed`` reruns the cases that failed in the
JSON file; ``--report`` regenerates the docs table from it.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(Path(__file__).resolve().parent)]

JSON = ROOT / "docs" / "model_sweep.json"
DOC = ROOT / "docs" / "benchmarks.md"
BEGIN, END = "<!-- model_sweep: begin -->", "<!-- model_sweep: end -->"
SOURCES = ("torchvision", "timm", "transformers")
TIMM_CACHE = Path(tempfile.gettempdir()) / "ngdist_timm_families.json"
MEMORY = 8 << 30  # bytes a model's process may hold resident (a failed row past it)
CPU_SECONDS = 600  # CPU seconds a model's process may use (a failed row past it)


def catalogue(sources: tuple[str, ...] = SOURCES, all_constructors: bool = True) -> list[Any]:
    """The sweep's cases (ngdist.zoo_sweep.Case) of ``sources``, taken in turn from each
    source and Hugging Face task, so that a sweep cut short has sampled every group."""
    groups: list[list[Any]] = []
    if "torchvision" in sources:
        from ngdist.zoo_sweep import torchvision_cases
        groups.append(torchvision_cases(all_constructors))
    if "timm" in sources:
        from ngdist.zoo_sweep import timm_cases
        groups.append(timm_cases(TIMM_CACHE))
    if "transformers" in sources:
        from ngdist.zoo_sweep_hf import TASKS, hf_cases
        groups += [hf_cases((task,)) for task in TASKS]
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups
            if i < len(g)]


def find_case(name: str, family: str) -> Any:
    """The case ``name`` without enumerating a catalogue (what a subprocess runs)."""
    from ngdist import zoo_sweep, zoo_sweep_hf

    source, rest = name.split("/", 1)
    if source == "tv":
        return zoo_sweep.Case(name, family, "torchvision", lambda: zoo_sweep._tv_build(rest))
    if source == "timm":
        return zoo_sweep.Case(name, family, "timm", lambda: zoo_sweep._timm_build(rest))
    task, model_type = rest.split("/", 1)
    return zoo_sweep.Case(name, family, "transformers",
                          lambda: zoo_sweep_hf._build(task, model_type))


def run_one(name: str, family: str, cpu_seconds: float, wall_seconds: float | None = None,
            memory: int | None = None) -> dict[str, Any]:
    """``name`` checked in a subprocess limited to ``cpu_seconds`` of CPU time (the machine's
    load does not count against a model), to ``wall_seconds`` (default 5x that) of wall
    time (a hang blocks without using CPU) and to ``memory`` (default ``MEMORY``) bytes
    resident (checked twice a second: the machine is shared); a limit reached or a crash is a
    failed row. A row run under a larger cap than ``MEMORY`` or ``CPU_SECONDS`` says so
    (``memory_cap``, ``cpu_limit``)."""
    import resource
    import signal

    row: dict[str, Any] = {"name": name, "family": family, "status": "fail",
                           "source": {"tv": "torchvision", "timm": "timm"}.get(
                               name.split("/")[0], "transformers")}
    memory = memory or MEMORY
    limits = {**({"memory_cap": f"{memory / (1 << 30):g} GiB"} if memory > MEMORY else {}),
              **({"cpu_limit": f"{cpu_seconds:g} s"} if cpu_seconds > CPU_SECONDS else {})}
    row.update(limits)

    def limit_cpu() -> None:
        resource.setrlimit(resource.RLIMIT_CPU, (int(cpu_seconds), int(cpu_seconds) + 10))

    wall = wall_seconds or 5 * cpu_seconds
    with tempfile.TemporaryDirectory() as tmp:
        result, log = Path(tmp) / "result.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--one", name, "--family", family,
               "--result", str(result)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
        with open(log, "w") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env,
                                    cwd=tmp, preexec_fn=limit_cpu, start_new_session=True)
            stop, cpu = _watch(proc, wall, memory)
            if stop:
                return {**row, **stop}
        _end_group(proc.pid)  # a forked oracle its process left behind (past its CPU limit)
        if result.exists():
            return {**json.loads(result.read_text()), **limits}
        if proc.returncode == -signal.SIGXCPU or (proc.returncode == -signal.SIGKILL
                                                   and cpu >= cpu_seconds - 1):
            return {**row, "stage": "timeout", "error": f"more than {cpu_seconds:.0f} s of CPU"}
        if proc.returncode == -signal.SIGKILL:
            return {**row, "stage": "killed",
                    "error": f"killed (SIGKILL) after {cpu:.0f} s of CPU, below its limit: the "
                             "machine's out-of-memory killer or another process ended it"}
        tail = " ".join(log.read_text().strip().splitlines()[-3:])[-400:]
        return {**row, "stage": "crash", "error": f"exit {proc.returncode}: {tail}"}


def _end_group(pid: int) -> None:
    """Kills the process group of a model's process (its own session: the process and the
    torch oracle it forks), if any of it is left."""
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _watch(proc: subprocess.Popen, wall: float, memory: int
           ) -> tuple[dict[str, str] | None, float]:
    """Waits for a model's process: (the failed row's stage and error where it ran past
    ``wall`` seconds or ``memory`` bytes resident, its process group then ended; the CPU
    seconds of the process itself, its forked oracle's apart, when last seen alive)."""
    import time

    deadline, cpu = time.monotonic() + wall, 0.0
    while proc.poll() is None:
        stop = None
        if time.monotonic() > deadline:
            stop = {"stage": "timeout", "error": f"no result within {wall:.0f} s of wall time"}
        elif _resident(proc.pid) > memory:
            stop = {"stage": "memory", "error": f"more than {memory >> 20} MiB resident"}
        if stop:
            _end_group(proc.pid)
            proc.wait()
            return stop, cpu
        cpu = max(cpu, _cpu_seconds(proc.pid))
        time.sleep(0.5)
    return None, cpu


def _cpu_seconds(pid: int) -> float:
    """CPU seconds (user and system) of process ``pid`` itself (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _resident(pid: int) -> int:
    """Bytes resident of process ``pid`` (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) << 10
    except OSError:
        pass
    return 0


def _one(args: argparse.Namespace) -> None:
    import logging

    from sweep_check import check

    import resource

    logging.basicConfig(level=logging.WARNING)
    row = check(find_case(args.one, args.family))
    use, oracle = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                       resource.RUSAGE_CHILDREN))
    row["cpu_s"] = use.ru_utime + use.ru_stime + oracle.ru_utime + oracle.ru_stime
    # resident peaks (KiB on Linux): the model's process, which the cap holds, and the
    # largest of the torch oracle's processes (sweep_check.forked)
    row["peak_mib"], row["oracle_peak_mib"] = use.ru_maxrss >> 10, oracle.ru_maxrss >> 10
    Path(args.result).write_text(json.dumps(row, default=float))


# --------------------------------------------------------------------------- report

def _fmt(value: Any, spec: str) -> str:
    return "" if value is None else format(value, spec)


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    built = [r for r in rows if r.get("stage") != "build"]
    passed = [r for r in rows if r["status"] == "pass"]
    ratios = [r["ratio"] for r in passed if r.get("ratio")]
    return {"cases": len(rows), "built": len(built), "passed": len(passed),
            "pass_pct": 100.0 * len(passed) / len(built) if built else 0.0,
            "median_ratio": statistics.median(ratios) if ratios else None}


def table(rows: list[dict[str, Any]]) -> str:
    s = summary(rows)
    lines = [f"{s['cases']} models, {s['built']} built, {s['passed']} passed "
             f"(**{s['pass_pct']:.1f}%** of those built); median step ratio ngdist / eager "
             f"torch over the passing models: **{_fmt(s['median_ratio'], '.2f')}**.", "",
             "Errors: worst tensor, relative, from torch float64 (the gradients; the state "
             "after each AdamW step, from the state ngdist reached); torch f32: torch's own "
             "worst float32 error of the gradients (a tensor's bound is 1e-4 or 10x torch's "
             "float32 error of that tensor, whichever is larger).", "",
             "| family | model | result | failing stage: cause | grad err | torch f32 | "
             "AdamW err | ngdist / torch |", "|---|---|---|---|---:|---:|---:|---:|"]
    for r in sorted(rows, key=lambda r: r["name"]):
        cause = "" if r["status"] == "pass" else f"{r.get('stage', '')}: {r.get('error', '')}"
        if r.get("first_batch"):
            cause += f" (on a second batch; the first: {r['first_batch']})"
        if r.get("memory_cap"):
            cause += f" (run under a resident cap of {r['memory_cap']})"
        if r.get("cpu_limit"):
            cause += f" (run under a CPU limit of {r['cpu_limit']})"
        if r.get("raw_in_ngdist"):
            cause += f" (raised inside ngdist at {r['raw_in_ngdist']})"
        cause = cause.replace("|", "\\|")
        lines.append(f"| {r['family']} | {r['name'].split('/')[-1]} | {r['status']} | {cause} "
                     f"| {_fmt(r.get('grad_err'), '.1e')} | {_fmt(r.get('torch32_err'), '.1e')} | "
                     f"{_fmt(r.get('adamw_err'), '.1e')} | "
                     f"{_fmt(r.get('ratio'), '.2f')} |")
    return "\n".join(lines)


def write_docs(rows: list[dict[str, Any]], when: str) -> None:
    text = DOC.read_text()
    body = (f"{BEGIN}\n`python benchmarks/model_sweep.py`, results of {when} "
            f"(docs/model_sweep.json holds every row):\n\n{table(rows)}\n{END}")
    if BEGIN in text:
        head, rest = text.split(BEGIN, 1)
        text = head + body + rest.split(END, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n## Model sweep: torchvision, timm, Hugging Face\n\n" + \
            "Written by `benchmarks/model_sweep.py` (do not edit by hand).\n\n" + body + "\n"
    DOC.write_text(text)


def merge(path: Path, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` into the JSON file ``path`` (by name; a sweep running beside this one keeps
    its rows: the file is read again under a lock before each write). Returns all rows."""
    import fcntl

    with open(Path(tempfile.gettempdir()) / "ngdist_model_sweep.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        old = {r["name"]: r for r in json.loads(path.read_text())} if path.exists() else {}
        old.update({r["name"]: r for r in rows})
        out = sorted(old.values(), key=lambda r: r["name"])
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, indent=1, default=float))
        tmp.replace(path)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--source", nargs="+", choices=SOURCES, default=list(SOURCES))
    p.add_argument("--only", nargs="+", help="case names, or name prefixes ending in /")
    p.add_argument("--failed", action="store_true", help="rerun the JSON file's failures")
    p.add_argument("--json", type=Path, default=JSON, help="the results file rows merge into")
    p.add_argument("--merge", type=Path, nargs="+", default=[],
                   help="fold these results files into --json first")
    p.add_argument("--report", action="store_true",
                   help="only regenerate the docs table from --json")
    p.add_argument("--timeout", type=float, default=CPU_SECONDS,
                   help="CPU seconds of a model's process: export, both compiles, the steps "
                        "and eager torch (the forked oracle has a limit of its own); wall "
                        "time: 5x that; a row run above the default says so")
    p.add_argument("--memory", type=float, default=MEMORY / (1 << 30),
                   help="GiB a model's process may hold resident (its torch oracle, a forked "
                        "child, besides); a row run above the default says so")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--all-constructors", action="store_true",
                   help="every torchvision constructor, not the smallest of each family")
    p.add_argument("--limit", type=int, help="the first N cases (in turn from each group)")
    p.add_argument("--skip-done", action="store_true",
                   help="leave out the cases the JSON file already holds")
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--no-docs", action="store_true", help="leave docs/benchmarks.md alone")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--family", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return _one(args)
    from tqdm import tqdm

    for extra in args.merge:
        merge(args.json, json.loads(extra.read_text()))
    old = {r["name"]: r for r in merge(args.json, [])}
    if args.report:
        return write_docs(list(old.values()), datetime.datetime.now(
            datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"))
    cases = [(c.name, c.family) for c in catalogue(tuple(args.source), args.all_constructors)]
    if args.only:
        known = {c[0] for c in cases}
        cases = [c for c in cases if any(c[0] == o or (o.endswith("/") and c[0].startswith(o))
                                         for o in args.only)]
        cases += [(o, o) for o in args.only  # a torchvision or timm model beyond the catalogue
                  if o not in known and not o.endswith("/") and o.split("/")[0] in ("tv", "timm")]
    if args.failed:
        cases = [(n, r["family"]) for n, r in old.items() if r["status"] != "pass"]
    if args.skip_done:
        cases = [c for c in cases if c[0] not in old]
    cases = cases[:args.limit]
    if args.list:
        print("\n".join(f"{n}\t{f}" for n, f in cases))
        return None
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool, \
            tqdm(total=len(cases), unit="model") as bar:
        futures = [pool.submit(run_one, n, f, args.timeout, None, int(args.memory * (1 << 30)))
                   for n, f in cases]
        for fut in concurrent.futures.as_completed(futures):
            row = fut.result()
            rows = merge(args.json, [row])
            bar.set_postfix_str(f"{row['name']} {row['status']}")
            bar.update()
    rows = merge(args.json, [])
    print(table(rows))
    if not args.no_docs:
        write_docs(rows, datetime.datetime.now(datetime.timezone.utc).strftime(
            "%Y-%m-%d %H:%M UTC"))
    return None


if __name__ == "__main__":
    main()
