"""Training metrics: per-step loss, throughput and times, per-epoch validation, written by rank 0.

``MetricsLog(log_dir, group)`` is made by the Trainer (``ngdist.compile(..., log_dir=DIR)``,
``ngdist train --log-dir DIR``) on every training rank, with a group of the training ranks of
its own (a ``split`` of the trainer's group, so its messages never meet the step's). Steps are
recorded locally and reduced over the ranks every ``every`` steps with one in-place allreduce
of a small float64 array (``every`` rows x ``FIELDS``), so logging adds one collective per
interval rather than per step. Rank 0 then writes:

* ``metrics.csv``: one row per step (``split=train``) and one per validation (``split=val``),
  each row written whole and flushed; a train row's ``lr`` is the learning rate the step ran
  with (of the first parameter group). A ``log_dir`` that already holds a ``metrics.csv`` is
  refused before training (one file per run; choose a new folder or remove the old file),
  except by a job restarted by ``ngdist run --max-restarts`` (``NGDIST_RESTART_COUNT`` > 0) or
  resumed from a checkpoint: its rows go on in the same file, from the resumed step.
* TensorBoard event files (``events.out.tfevents.*``, tags ``train/loss``,
  ``train/samples_per_s``, ``train/compute_s``, ``train/comm_s``, ``train/wait_s``,
  ``train/lr``, ``val/loss``, ``val/accuracy``) when ``tensorboard`` is installed.
* ``metrics.png`` at ``close()``: the training loss vs step (validation loss on the same axes)
  and the validation accuracy vs epoch, drawn with matplotlib's Agg canvas when matplotlib is
  installed, written atomically.

Without tensorboard or matplotlib the CSV is still written and one warning says that the rest
needs ``pip install 'ngdist[metrics]'``.

``eval_loss`` and ``loss_terms`` give ``Trainer.evaluate`` the kind of the step's loss
(softmax_cross_entropy or mse) and its sums over a validation batch, in float64.
"""
from __future__ import annotations

import csv
import importlib
import io
import logging
import math
import os
import socket
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir

from ngdist.comm import ProcessGroup
from ngdist.errors import InputError, NgdistError
from ngdist.ir.atomic import write_atomic

logger = logging.getLogger(__name__)

CSV_NAME = "metrics.csv"
PNG_NAME = "metrics.png"
COLUMNS = ("step", "epoch", "split", "loss", "accuracy", "samples_per_s", "step_time_s",
           "compute_s", "comm_s", "wait_s", "samples", "lr", "grad_norm")
# what each rank contributes per step; summed over the ranks
FIELDS = ("loss", "samples", "step_time_s", "compute_s", "comm_s", "wait_s")
DEFAULT_EVERY = 10
EXTRA_HINT = "pip install 'ngdist[metrics]'"


@dataclass(frozen=True)
class Evaluation:
    """A validation result combined over the training ranks: ``loss`` is the mean per-sample
    loss of the whole set, ``accuracy`` the fraction of samples whose arg-max is the label
    (None for a loss that is not a classification)."""

    loss: float
    accuracy: float | None
    samples: int


def existing_log(log_dir: str | os.PathLike) -> str:
    """Why ``log_dir`` cannot take a run's metrics ('' when it can): it holds a metrics.csv."""
    path = Path(log_dir) / CSV_NAME
    if not path.exists():
        return ""
    return (f"{path} already exists: each run writes its own metrics; give another log "
            "directory (--log-dir, log_dir=) or remove the old file")


def _optional(module: str) -> Any | None:
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


class MetricsLog:
    """Per-step and per-epoch metrics of one training run; see the module docstring. Every
    method that reduces (``record`` at the end of an interval, ``flush``, ``validation``,
    ``close``) is collective over ``group``."""

    def __init__(self, log_dir: str | os.PathLike, group: ProcessGroup,
                 every: int = DEFAULT_EVERY, title: str | None = None,
                 resume: bool = False) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise InputError(f"log_every must be a whole number of steps, at least 1; got "
                             f"{every!r}")
        self.dir = Path(log_dir)
        self.group = group
        self.every = every
        self.title = title or f"ngdist training on {group.size} rank(s)"
        self.pending: list[np.ndarray] = []
        self.rows: list[dict[str, Any]] = []  # rank 0: what the CSV holds, for the PNG
        self._csv: Any = None
        self._writer: Any = None
        self._events: Any = None
        self._closed = False
        self.resume = resume  # a restarted job (checkpoints): rows go on in the same CSV
        problem = self._open() if group.rank == 0 else ""
        # every rank learns rank 0's verdict, so that all refuse together (none waits)
        flag = np.array([1.0 if problem else 0.0])
        group.broadcast(flag, 0, "metrics log set-up").wait()
        if flag[0]:
            raise InputError(problem or f"{self.dir}: rank 0 could not open the metrics log; "
                             "see its message")

    def _open(self) -> str:
        """Rank 0: the CSV (refused if present), the event writer; '' or what went wrong."""
        path = self.dir / CSV_NAME
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            mode = "a" if self.resume else "x"
            self._csv = open(path, mode, newline="", encoding="utf-8")  # noqa: SIM115
        except FileExistsError:
            return existing_log(self.dir)
        except OSError as exc:
            return f"{self.dir}: cannot write the metrics log there ({exc})"
        self._writer = csv.writer(self._csv)
        if self._csv.tell() == 0:
            self._writer.writerow(COLUMNS)
        self._csv.flush()
        missing = [m for m in ("tensorboard", "matplotlib") if _optional(m) is None]
        if missing:
            logger.warning("metrics: TensorBoard event files and the PNG of the curves need %s "
                           "(missing: %s); writing %s only", EXTRA_HINT, ", ".join(missing),
                           path)
        if "tensorboard" not in missing:
            self._events = EventWriter(self.dir)
        return ""

    # ------------------------------------------------------------------ recording
    def record(self, step: int, epoch: int | None, stats: Any) -> None:
        """One step's ``StepStats`` of this rank; reduced and written every ``every`` steps."""
        lr = getattr(stats, "lr", None)  # the same on every rank: not reduced
        norm = getattr(stats, "grad_norm", None)  # of the averaged gradients: the same too
        self.pending.append(np.array(
            [step, -1 if epoch is None else epoch, np.nan if lr is None else lr,
             np.nan if norm is None else norm, stats.loss,
             stats.samples, stats.step_time, stats.compute_time, stats.comm_time,
             stats.wait_time], np.float64))
        if len(self.pending) >= self.every:
            self.flush()

    def flush(self) -> None:
        """Collective: reduce the recorded steps over the ranks and write their rows."""
        if not self.pending:
            return
        table = np.stack(self.pending)
        self.pending = []
        sums = np.ascontiguousarray(table[:, 4:])
        self.group.allreduce(sums, "metrics: step statistics of the interval").wait()
        n = self.group.size
        for (step, epoch, lr, norm), row in zip(table[:, :4], sums):
            loss, samples, step_time, compute, comm, wait = row
            mean_time = step_time / n  # the ranks' mean step time
            self._write({
                "step": int(step), "epoch": None if epoch < 0 else int(epoch), "split": "train",
                "loss": loss / n, "accuracy": None,
                "samples_per_s": samples / mean_time if mean_time > 0 else float("nan"),
                "step_time_s": mean_time, "compute_s": compute / n, "comm_s": comm / n,
                "wait_s": wait / n, "samples": int(samples),
                "lr": None if np.isnan(lr) else lr,
                "grad_norm": None if np.isnan(norm) else norm})

    def validation(self, step: int, epoch: int | None, result: Evaluation) -> None:
        """A validation result (already combined over the ranks), after the pending steps."""
        self.flush()
        self._write({"step": step, "epoch": epoch, "split": "val", "loss": result.loss,
                     "accuracy": result.accuracy, "samples": result.samples})

    def _write(self, row: dict[str, Any]) -> None:
        if self.group.rank != 0:
            return
        self.rows.append(row)
        self._writer.writerow(["" if row.get(c) is None else _fmt(row[c]) for c in COLUMNS])
        self._csv.flush()
        if self._events is not None:
            self._add_scalars(row)

    def _add_scalars(self, row: dict[str, Any]) -> None:
        prefix = row["split"]
        names = ("loss", "accuracy") if prefix == "val" else \
            ("loss", "samples_per_s", "compute_s", "comm_s", "wait_s", "lr", "grad_norm")
        self._events.scalars(row["step"], {f"{prefix}/{k}": row[k] for k in names
                                           if row.get(k) is not None})

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """Collective: write what is pending, close the files, draw the PNG (rank 0)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        if self.group.rank != 0:
            return
        self._csv.close()
        if self._events is not None:
            self._events.close()
        if _optional("matplotlib") is not None:
            write_atomic(self.dir / PNG_NAME, plot_png(self.rows, self.title))


class EventWriter:
    """A TensorBoard event file (``events.out.tfevents.<time>.<host>.<pid>``) written
    synchronously with tensorboard's own record framing and protos. tensorboard's
    ``EventFileWriter`` is not used: it opens files through ``tensorboard.compat.tf``, which
    imports TensorFlow (seconds, and its log lines) whenever TensorFlow is installed."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2 = event_pb2
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}"
        self._records = RecordWriter(open(log_dir / name, "wb"))  # noqa: SIM115
        self._write(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))

    def _write(self, event: Any) -> None:
        self._records.write(event.SerializeToString())
        self._records.flush()

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """One event holding the scalar ``values`` (tag -> value) of ``step``."""
        from tensorboard.compat.proto import summary_pb2

        summary = summary_pb2.Summary(value=[summary_pb2.Summary.Value(
            tag=tag, simple_value=float(v)) for tag, v in values.items()])
        self._write(self._event_pb2.Event(wall_time=time.time(), step=int(step),
                                          summary=summary))

    def close(self) -> None:
        self._records.close()


def _fmt(value: Any) -> str:
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


def plot_png(rows: Sequence[dict[str, Any]], title: str) -> bytes:
    """The PNG of the curves: training (and validation) loss vs step, validation accuracy vs
    epoch; matplotlib's Agg canvas, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(1, 2)
    ax_loss.plot([r["step"] for r in train], [r["loss"] for r in train], lw=1,
                 label="training loss (mean over ranks)")
    if val:
        ax_loss.plot([r["step"] for r in val], [r["loss"] for r in val], "o-",
                     label="validation loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")
    ax_loss.grid(alpha=0.3)
    ax_loss.legend()
    scored = [r for r in val if r.get("accuracy") is not None]
    if scored:
        xs = [r["epoch"] if r["epoch"] is not None else i + 1 for i, r in enumerate(scored)]
        ax_acc.plot(xs, [r["accuracy"] for r in scored], "o-", color="tab:green")
        ax_acc.set_ylim(0, 1.02)
    else:
        note = "no validation accuracy\n(not a classification loss)" if val else \
            "no validation data"
        ax_acc.text(0.5, 0.5, note, ha="center", va="center", transform=ax_acc.transAxes)
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("validation accuracy")
    ax_acc.set_title("validation accuracy")
    ax_acc.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()

def eval_loss(step: ir.Model, loss: str, data_inputs: Mapping[str, Any],
               label_checks: Mapping[str, tuple[str, int | None, int | None]]
               ) -> tuple[str, str, str, int | None]:
    """(kind, scores, labels, ignore_index) of the step's loss, for ``evaluate``: a
    SoftmaxCrossEntropyLoss of model scores against labels (``softmax_cross_entropy``), or the
    mean of the squared difference of an output and the labels (``mse``, as the ONNX frontend
    builds it)."""
    producers = {o.name: n for n in step.graph for o in n.outputs}
    node = producers.get(loss)
    divisor = node.inputs[1].producer() if node is not None and node.op_type == "Div" else None
    if divisor is not None and divisor.domain == "ngdist" and divisor.op_type == "AllReduce":
        node = node.inputs[0].producer()  # a sum over the global count (passes/losscount.py)
    weighted = node is not None and len(node.inputs) > 2 and node.inputs[2] is not None
    if node is not None and node.op_type == "SoftmaxCrossEntropyLoss" and not weighted:
        for labels, (scores, ignore, _) in label_checks.items():
            if scores == node.inputs[0].name:
                return "softmax_cross_entropy", scores, labels, ignore
    if node is not None and node.op_type == "ReduceMean":
        square = node.inputs[0].producer() if node.inputs[0] is not None else None
        sub = square.inputs[0].producer() if square is not None and square.op_type == "Mul" \
            else None
        if sub is not None and sub.op_type == "Sub" and sub.inputs[1].name in data_inputs:
            return "mse", sub.inputs[0].name, sub.inputs[1].name, None
    what = f"a {node.op_type} node" if node is not None else "no node of the step graph"
    what += " with class weights" if weighted else ""
    raise NgdistError(f"evaluate() computes the validation loss of softmax_cross_entropy and mse "
                      f"losses against a labels input; this model's loss '{loss}' comes from "
                      f"{what}: evaluate with trainer.predict() and your own metric instead")


def loss_terms(kind: str, scores: np.ndarray, labels: np.ndarray, ignore: int | None
                ) -> np.ndarray:
    """[sum of losses, correct predictions, samples (or elements) counted], in float64."""
    if kind == "mse":
        diff = scores - np.asarray(labels, np.float64)
        return np.array([float(np.sum(diff * diff)), 0.0, float(diff.size)])
    # scores [N, C, d1...] as SoftmaxCrossEntropyLoss takes them (classes on axis 1), labels
    # [N, d1...]: one row per labelled element
    scores = np.moveaxis(scores, 1, -1).reshape(-1, scores.shape[1])
    y = np.asarray(labels).astype(np.int64).reshape(-1)
    if ignore is not None:
        scores, y = scores[y != ignore], y[y != ignore]
    top = scores.max(axis=1, keepdims=True)
    log_z = np.log(np.exp(scores - top).sum(axis=1)) + top.squeeze(1)
    picked = np.take_along_axis(scores, y[:, None], axis=1).squeeze(1)
    correct = float(np.sum(scores.argmax(axis=1) == y))
    return np.array([float(np.sum(log_z - picked)), correct, float(y.size)])
