"""``ngdist.launch(fn, n=4, args=(...))``: run a function on ``n`` ranks from plain Python or a
notebook (Horovod's ``horovod.run``, accelerate's ``notebook_launcher``); inside a Slurm
allocation through ``srun``, as ``ngdist run`` (comm/launch.py).

The caller pickles ``(fn, args, kwargs)`` into a fresh folder, starts ``n`` ranks of this
Python under the supervisor of ``ngdist run`` (comm/supervisor.py: a failed rank stops the
others after ``grace`` seconds, Ctrl-C / the notebook's interrupt stops every rank), each rank
calls ``fn(*args, **kwargs)`` and writes its return value (or its exception) into the folder,
and the caller returns the values in rank order, or raises ``LaunchError`` with the message
of the rank that failed first (its exception, when it unpickles, is the ``__cause__``).

Functions are sent by value when the ranks could not import them by name: those defined in
``__main__`` (a script, ``python -c``, a notebook cell) and nested ones (lambdas, closures):
their code object (``marshal``: the ranks run this same interpreter), defaults, closure cells
and the globals the code names (recursively; modules by name). Everything else (functions and
classes of importable modules, numpy arrays, ...) goes by ``pickle``'s reference rules. A class
defined in ``__main__`` cannot be sent (the ranks' ``__main__`` does not have it): it is
refused with a message that says to move it into a module. No dependency beyond the standard
library (cloudpickle does the same with more cases).
"""
from __future__ import annotations

import builtins
import importlib
import io
import logging
import marshal
import os
import pickle
import shutil
import sys
import tempfile
import traceback
import types
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from ngdist.comm.launch import slurm_allocation, slurm_env
from ngdist.comm.supervisor import JobResult, supervise
from ngdist.errors import LaunchError

logger = logging.getLogger(__name__)

RANK_MAIN = "import sys; from ngdist.launcher import rank_main; sys.exit(rank_main(sys.argv[1]))"


def launch(fn: Callable[..., Any], n: int = 2, args: Sequence[Any] = (),
           kwargs: Mapping[str, Any] | None = None, *, timeout: float | None = None,
           grace: float = 3.0, prefix: bool = True,
           env: Mapping[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``n`` ranks; their return values in rank order.

    ``timeout``: seconds before a stuck collective fails (``NGDIST_TIMEOUT`` on the ranks);
    ``grace``: seconds the other ranks may run after one failed; ``prefix``: start each line a
    rank prints with ``[rank N]``; ``env``: the ranks' environment (default: this process's).
    Raises ``LaunchError`` naming the rank that failed first and its error, KeyboardInterrupt
    when the job was stopped by SIGINT."""
    if not callable(fn):
        raise LaunchError(f"ngdist.launch needs a function to run, got {type(fn).__name__}")
    if n < 1:
        raise LaunchError(f"ngdist.launch needs at least 1 rank, got n={n}")
    folder = Path(tempfile.mkdtemp(prefix="ngdist-launch-"))
    try:
        (folder / "payload.pkl").write_bytes(dumps((fn, tuple(args), dict(kwargs or {}))))
        ranks_env = dict(os.environ if env is None else env)
        if slurm_allocation(ranks_env) is not None:  # as ngdist run: through srun
            ranks_env = slurm_env(ranks_env)
        if timeout is not None:
            ranks_env["NGDIST_TIMEOUT"] = str(timeout)
        result = supervise([sys.executable, "-c", RANK_MAIN, str(folder)], n, env=ranks_env,
                           prefix=prefix, grace=grace, stdout=_binary(sys.stdout),
                           stderr=_binary(sys.stderr))
        if result.received is not None:
            raise KeyboardInterrupt(f"ngdist.launch: the job was stopped by signal "
                                    f"{result.received}")
        if result.status != 0:
            raise _failure(result, folder)
        return [_read(folder / f"result.{rank}.pkl", rank) for rank in range(n)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------- on the ranks

def rank_main(folder: str) -> int:
    """What each rank runs: the payload's function, its value or exception into ``folder``."""
    rank = int(os.environ.get("PMI_RANK", "0"))
    where = Path(folder)
    fn, args, kwargs = pickle.loads((where / "payload.pkl").read_bytes())
    try:
        value = fn(*args, **kwargs)
        data = _dumps_value(value, rank)
    except BaseException as exc:  # noqa: BLE001 - every way fn fails goes back to the caller
        _write(where / f"error.{rank}.pkl", _error_record(exc))
        raise
    _write(where / f"result.{rank}.pkl", data)
    return 0


def _dumps_value(value: Any, rank: int) -> bytes:
    try:
        return dumps(value)
    except Exception as exc:  # noqa: BLE001 - pickle raises several kinds
        raise LaunchError(f"rank {rank}'s return value ({type(value).__name__}) cannot be "
                          f"pickled ({exc}); return numbers, arrays or other picklable "
                          "values") from None


def _error_record(exc: BaseException) -> bytes:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        original: bytes | None = pickle.dumps(exc)
    except Exception:  # noqa: BLE001 - an exception that cannot be pickled goes as text
        original = None
    return pickle.dumps({"type": type(exc).__name__, "message": str(exc), "traceback": text,
                         "exception": original})


def _write(path: Path, data: bytes) -> None:
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


# ---------------------------------------------------------------------- in the caller

def _failure(result: JobResult, folder: Path) -> BaseException:
    """The LaunchError of a failed job: the exception a rank wrote first (the others' most
    likely report its absence), else how the rank that failed first ended."""
    written = sorted(folder.glob("error.*.pkl"),
                     key=lambda p: (p.stat().st_mtime_ns, int(p.name.split(".")[1])))
    if written:
        rank = int(written[0].name.split(".")[1])
        record = pickle.loads(written[0].read_bytes())
        first = (record["message"].strip().splitlines() or [""])[0]
        error = LaunchError(f"rank {rank} failed: {record['type']}: {first}"
                            if first else f"rank {rank} failed: {record['type']}")
        error.rank, error.remote_traceback = rank, record["traceback"]
        error.__cause__ = _unpickled(record["exception"])
        return error
    failed = [result.first_failed] if result.first_failed is not None else []
    failed += [s.rank for s in result.ranks if s.failed]
    if failed:
        status = result.ranks[failed[0]]
        said = f": {status.error}" if status.error else ""
        error = LaunchError(f"rank {status.rank} failed ({status.describe()}){said}")
        error.rank, error.remote_traceback = status.rank, None
        return error
    return LaunchError(f"the job failed (mpiexec exit status {result.launcher_status})")


def _unpickled(data: bytes | None) -> BaseException | None:
    if data is None:
        return None
    try:
        exc = pickle.loads(data)
    except Exception:  # noqa: BLE001 - e.g. a class the caller cannot import
        return None
    return exc if isinstance(exc, BaseException) else None


def _read(path: Path, rank: int) -> Any:
    if not path.exists():  # fn returned, yet no value: the rank's process was replaced
        raise LaunchError(f"rank {rank} exited 0 without returning from the function "
                          "(did it call sys.exit or os._exit?)")
    return pickle.loads(path.read_bytes())


class _TextSink(io.RawIOBase):
    """Bytes written to a text stream (a notebook's ``sys.stdout`` has no ``buffer``)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        self.stream.write(bytes(data).decode("utf-8", errors="replace"))
        return len(data)

    def flush(self) -> None:
        self.stream.flush()


def _binary(stream: TextIO) -> Any:
    return getattr(stream, "buffer", None) or _TextSink(stream)


# ---------------------------------------------------------------------- functions by value

def dumps(obj: Any) -> bytes:
    """``pickle.dumps`` that sends functions the ranks cannot import by value (see the
    module docstring)."""
    out = io.BytesIO()
    _ByValuePickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


class _ByValuePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, types.ModuleType):
            return importlib.import_module, (obj.__name__,)
        if isinstance(obj, type) and obj.__module__ == "__main__":
            raise LaunchError(f"class {obj.__qualname__} is defined in __main__ (a script or "
                              "a notebook), which the ranks cannot import: ngdist.launch sends "
                              "functions by value but classes by name; move it into a module")
        if isinstance(obj, types.FunctionType) and _by_value(obj):
            return _function_reduce(obj)
        return NotImplemented


def _by_value(fn: types.FunctionType) -> bool:
    if fn.__module__ in (None, "__main__") or "<locals>" in fn.__qualname__ \
            or fn.__name__ == "<lambda>":
        return True
    module = sys.modules.get(fn.__module__)
    found: Any = module
    for part in fn.__qualname__.split("."):
        found = getattr(found, part, None)
    return found is not fn


def _function_reduce(fn: types.FunctionType) -> tuple[Any, ...]:
    """A reduce tuple whose state (globals, defaults, closure) is set after the function
    exists, so that a function that names itself (recursion) pickles."""
    code = marshal.dumps(fn.__code__)
    cells = len(fn.__closure__ or ())
    names = set(_global_names(fn.__code__))
    state = {"globals": {k: v for k, v in fn.__globals__.items() if k in names},
             "defaults": fn.__defaults__, "kwdefaults": fn.__kwdefaults__,
             "closure": [_cell_value(c) for c in fn.__closure__ or ()],
             "dict": dict(fn.__dict__), "qualname": fn.__qualname__, "module": fn.__module__}
    return _make_function, (code, fn.__name__, cells), state, None, None, _fill_function


class _EmptyCell:
    """Stands for a closure cell not assigned yet."""


def _cell_value(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:
        return _EmptyCell()


def _global_names(code: types.CodeType) -> Iterator[str]:
    stack = [code]
    while stack:
        c = stack.pop()
        yield from c.co_names
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))


def _make_function(code: bytes, name: str, cells: int) -> types.FunctionType:
    closure = tuple(types.CellType() for _ in range(cells)) or None
    return types.FunctionType(marshal.loads(code), {"__builtins__": builtins}, name, None,
                              closure)


def _fill_function(fn: types.FunctionType, state: dict[str, Any]) -> None:
    fn.__globals__.update(state["globals"])
    fn.__defaults__, fn.__kwdefaults__ = state["defaults"], state["kwdefaults"]
    for cell, value in zip(fn.__closure__ or (), state["closure"]):
        if not isinstance(value, _EmptyCell):
            cell.cell_contents = value
    fn.__dict__.update(state["dict"])
    fn.__qualname__, fn.__module__ = state["qualname"], state["module"]


__all__ = ["LaunchError", "dumps", "launch", "rank_main"]
