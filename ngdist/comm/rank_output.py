"""The ranks' output as the supervisor reads it from mpiexec: split by rank, whole lines.

mpiexec runs with ``-prepend-pattern LABEL_PATTERN``: hydra puts the label ``\\x1eN\\x1f``
before every chunk of rank N's output and after every newline inside such a chunk. So the
bytes after a label, up to the next newline, are rank N's; bytes after a newline that no label
follows are mpiexec's own messages. (Hydra's ``-prepend-rank`` writes its ``[N] `` in the same
places, i.e. in the middle of a line when a rank writes a line in two pieces, and it cannot be
taken apart from the text again; hence a label that can.)

Each rank's bytes are reassembled into lines (``\\n``, ``\\r\\n`` or ``\\r``: a progress bar's
redraw) before they are written, so lines of two ranks never interleave. A line that stays
unfinished (a prompt, the last state of a progress bar) is written after ``IDLE_S`` anyway;
what follows continues it, unless another rank wrote in between: then that rank's text starts
on a new line, and the continuation too, with its prefix again. Every line of rank N is
written with the prefix ``[rank N] `` (unless ``prefix=False``), into ``LOG_DIR/rank.N.log``
unprefixed when a log directory is given, and scanned (``RankScan``). A log file takes a
progress bar's redraws as lines, at most one every ``LOG_REDRAW_S`` and the last state before
the bar's own line ends, instead of every redraw (tqdm redraws ten times a second). The wrapper's marker
lines (comm/rankwrap.py) are handed to a callback and not written anywhere.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from ngdist.comm.rankwrap import MARKER, parse_marker

LABEL_PATTERN = "\x1e%r\x1f"  # for mpiexec -prepend-pattern: %r is the rank
_LABEL = re.compile(rb"\x1e(\d+)\x1f")
_BREAK = re.compile(rb"\r\n|\r|\n")
IDLE_S = 0.25
LOG_REDRAW_S = 10.0  # a rank's log keeps a progress bar's state this often

MarkerCallback = Callable[[int, dict[str, int]], None]


_MPI_ABORT = re.compile(r"application called MPI_Abort\(\S+, (-?\d+)\)")
# what a rank prints right before it calls MPI_Abort (comm/abort.py, abort_job)
ABORT_LINE = "ngdist: rank {rank} aborts the MPI job (MPI_Abort code {code})\n"
_NGDIST_ABORT = re.compile(r"ngdist: rank \d+ aborts the MPI job \(MPI_Abort code (-?\d+)\)")


class RankScan:
    """What one rank's lines tell: its first error line (the last line of a Python traceback,
    i.e. the exception, else the first line that says "error" / "Error" / "ERROR"; lines inside
    a traceback, its frames and source lines, are never taken), and the code it called
    MPI_Abort with (MPICH prints "application called MPI_Abort(comm, code)", ngdist's
    ``abort_job`` announces it first, ``ABORT_LINE``, which survives where MPICH's line is lost
    with the launcher's exit), and its last line on stderr."""

    def __init__(self) -> None:
        self.traceback_end: str | None = None
        self.error_line: str | None = None
        self.abort_code: int | None = None
        # the last line on stderr: what ``SystemExit("msg")`` prints as a program ends
        self.last_stderr: str | None = None
        self._in_traceback: dict[str, bool] = {}

    @property
    def first(self) -> str | None:
        return self.traceback_end or self.error_line

    def line(self, stream: str, text: str) -> None:
        text = text.rstrip("\r\n")
        if stream == "stderr" and text.strip():
            self.last_stderr = text.strip()
        if self.abort_code is None and "MPI_Abort" in text:
            match = _MPI_ABORT.search(text) or _NGDIST_ABORT.search(text)
            self.abort_code = int(match.group(1)) if match else None
        if self._in_traceback.get(stream):
            if not text.strip() or text[:1] in (" ", "\t"):
                return
            self._in_traceback[stream] = False
            if self.traceback_end is None:
                self.traceback_end = text.strip()
            return
        if text.startswith("Traceback (most recent call last):"):
            self._in_traceback[stream] = True
        elif self.error_line is None and re.search("error|Error|ERROR", text):
            self.error_line = text.strip()


class _Line:
    """One unfinished line of one rank (or of mpiexec) on one stream."""

    def __init__(self) -> None:
        self.pending = bytearray()  # not written yet
        self.text = bytearray()     # the whole line so far, for the error scan
        self.started = False        # part of this line is written already
        self.since = 0.0


class OutputRouter:
    """Feeds mpiexec's stdout and stderr through the per-rank handling of the module docstring.
    ``outputs`` maps a stream name ("stdout", "stderr") to the binary stream to write."""

    def __init__(self, outputs: dict[str, BinaryIO], *, prefix: bool = True,
                 log_dir: Path | None = None, on_marker: MarkerCallback | None = None,
                 append: bool = False) -> None:
        self.outputs = outputs
        self.append = append  # add to the per-rank logs (a restarted job) instead of replacing
        self.prefix = prefix
        self.log_dir = log_dir
        self.on_marker = on_marker
        self.scans: dict[int, RankScan] = {}
        self.aborted: list[int] = []  # ranks that called MPI_Abort, in the order seen
        self._label: dict[str, int | None] = {s: None for s in outputs}
        self._carry: dict[str, bytes] = {s: b"" for s in outputs}
        self._lines: dict[tuple[str, int | None], _Line] = {}
        self._logs: dict[int, BinaryIO] = {}
        self._broken: set[str] = set()
        self._open: dict[str, _Line | None] = {s: None for s in outputs}  # written up to mid-line
        # per (stream, rank), for the rank's log: the last progress-bar state not logged yet,
        # when the log last took one, and the unfinished line
        self._redraw: dict[tuple[str, int], bytes] = {}
        self._redraw_logged: dict[tuple[str, int], float] = {}
        self._log_partial: dict[tuple[str, int], bytes] = {}

    def scan(self, rank: int) -> RankScan:
        return self.scans.get(rank) or RankScan()

    # ------------------------------------------------------------------ input
    def feed(self, stream: str, data: bytes) -> None:
        """A chunk read from mpiexec's ``stream``."""
        data = self._carry[stream] + data
        self._carry[stream] = b""
        cut = data.rfind(b"\x1e")
        if cut >= 0 and b"\x1f" not in data[cut:] and len(data) - cut < 12 \
                and (data[cut + 1:].isdigit() or cut + 1 == len(data)):
            data, self._carry[stream] = data[:cut], data[cut:]  # a label cut in two
        pos = 0
        for match in _LABEL.finditer(data):
            self._route(stream, data[pos:match.start()])
            self._label[stream] = int(match.group(1))
            pos = match.end()
        self._route(stream, data[pos:])
        self._flush(stream)

    def flush_idle(self, now: float | None = None) -> None:
        """Write the unfinished lines nothing was added to for ``IDLE_S``."""
        now = time.monotonic() if now is None else now
        for (stream, label), line in self._lines.items():
            if line.pending and now - line.since >= IDLE_S and MARKER[:1] not in line.pending:
                self._write(stream, label, bytes(line.pending), b"", line)
                line.pending.clear()
                self._flush(stream)

    def close(self) -> None:
        """End of input: write what is left, close the log files."""
        for (stream, label), line in self._lines.items():
            if line.pending:
                self._complete(stream, label, line, b"")
            if line.text and label is not None:  # a last line without its newline
                self._scan(stream, label, line)
        for (_, rank), content in self._redraw.items():  # a bar that never ended its line
            self._log(rank).write(content + b"\n")
        for (_, rank), content in self._log_partial.items():  # a last line without newline
            self._log(rank).write(content)
        self._redraw.clear()
        self._log_partial.clear()
        for stream in self.outputs:
            self._flush(stream)
        for fh in self._logs.values():
            fh.close()
        self._logs.clear()

    # ------------------------------------------------------------------ lines
    def _route(self, stream: str, piece: bytes) -> None:
        while piece:
            cut = piece.find(b"\n")
            if cut < 0:
                self._take(stream, self._label[stream], piece)
                return
            self._take(stream, self._label[stream], piece[:cut + 1])
            self._label[stream] = None  # no label after a newline: mpiexec's own text
            piece = piece[cut + 1:]

    def _take(self, stream: str, label: int | None, data: bytes) -> None:
        line = self._lines.get((stream, label))
        if line is None:
            line = self._lines[(stream, label)] = _Line()
        pos = 0
        for match in _BREAK.finditer(data):
            line.pending += data[pos:match.start()]
            self._complete(stream, label, line, match.group())
            pos = match.end()
        if pos < len(data):
            if not line.pending:
                line.since = time.monotonic()
            line.pending += data[pos:]

    def _complete(self, stream: str, label: int | None, line: _Line, end: bytes) -> None:
        content = bytes(line.pending)
        line.pending.clear()
        if label is not None:
            at = content.find(MARKER)
            if at >= 0:
                fields = parse_marker(content[at:])
                if fields is not None and self.on_marker is not None:
                    self.on_marker(label, fields)
                content, end = content[:at], b"\n"
                if not content and not line.started:
                    return
        self._write(stream, label, content, end, line)

    def _write(self, stream: str, label: int | None, content: bytes, end: bytes,
               line: _Line) -> None:
        other = self._open[stream]
        if other is not None and other is not line:  # another line is open: end it here
            self._emit(stream, b"\n")
            other.started = False
        self._open[stream] = line if not end else None
        if not content and end == b"\r" and not line.started:
            data = end  # a progress bar's leading carriage return: no prefix for it
        elif self.prefix and label is not None and not line.started:
            data = b"[rank %d] " % label + content + end
        else:
            data = content + end
        self._emit(stream, data)
        if label is None:
            line.started = not end
            return
        if self.log_dir is not None:
            self._log_piece(stream, label, content, end)
        line.text += content
        line.started = not end
        if end:
            self._scan(stream, label, line)

    def _scan(self, stream: str, label: int, line: _Line) -> None:
        text = bytes(line.text).decode("utf-8", "replace")
        line.text.clear()
        scan = self.scans.setdefault(label, RankScan())
        scan.line(stream, text)
        if scan.abort_code is not None and label not in self.aborted:
            self.aborted.append(label)

    def _log_piece(self, stream: str, rank: int, content: bytes, end: bytes) -> None:
        """Into the rank's log, by whole lines: a redraw (``\\r``) as a line when
        ``LOG_REDRAW_S`` have passed since the last one logged, else kept until the next; a
        line's end as it came. A piece written early to the terminal waits for its line."""
        key = (stream, rank)
        content = self._log_partial.pop(key, b"") + content
        if not end:
            self._log_partial[key] = content
        elif end != b"\r":
            self._redraw.pop(key, None)
            self._log(rank).write(content + end)
        elif content:
            now = time.monotonic()
            if now - self._redraw_logged.get(key, -LOG_REDRAW_S) >= LOG_REDRAW_S:
                self._redraw.pop(key, None)
                self._redraw_logged[key] = now
                self._log(rank).write(content + b"\n")
            else:
                self._redraw[key] = content

    def _log(self, rank: int) -> BinaryIO:
        fh = self._logs.get(rank)
        if fh is None:
            assert self.log_dir is not None
            self.log_dir.mkdir(parents=True, exist_ok=True)
            fh = self._logs[rank] = open(self.log_dir / f"rank.{rank}.log", "ab" if self.append else "wb")  # noqa: SIM115
        return fh

    # ------------------------------------------------------------------ output
    def _emit(self, stream: str, data: bytes) -> None:
        if stream in self._broken:
            return
        try:
            self.outputs[stream].write(data)
        except (OSError, ValueError):  # the reader went away (`| head`): keep draining
            self._broken.add(stream)

    def _flush(self, stream: str) -> None:
        if stream in self._broken:
            return
        try:
            self.outputs[stream].flush()
        except (OSError, ValueError):
            self._broken.add(stream)
        for fh in self._logs.values():
            fh.flush()
