"""Exceptions raised by ngdist. Every error a user can cause derives from NgdistError."""
from __future__ import annotations


class NgdistError(Exception):
    """Base class of every error ngdist raises on purpose."""


class ModelLoadError(NgdistError):
    """A file is not a readable ONNX model (missing, truncated, not ONNX)."""


class GraphError(NgdistError):
    """A graph cannot be processed as asked (bad structure, unknown names)."""


class GradientError(GraphError):
    """Reverse-mode differentiation is impossible, e.g. an op has no gradient rule."""


class OptionError(NgdistError):
    """An option that does not exist, belongs to another strategy, or has a wrong type."""


class ArgumentError(OptionError, ValueError):
    """A public function got a value it cannot use (also a ValueError, for code catching it)."""


class ArgumentTypeError(OptionError, TypeError):
    """A public function got a value of the wrong type (also a TypeError)."""


class InputError(NgdistError):
    """A batch given to ``Trainer.step`` does not fit the model."""


class CommError(NgdistError):
    """A communication op failed, or ranks disagree."""


class CommTimeoutError(CommError):
    """A collective did not complete within the configured timeout."""


class CheckpointError(NgdistError):
    """A checkpoint folder cannot be resumed from (another model's checkpoint, an unreadable
    manifest), or the strategy keeps per-rank state that one checkpoint cannot hold."""


class ExecutionError(NgdistError):
    """onnxruntime failed while running a compute segment (the message names the segment)."""


class OutOfMemoryError(ExecutionError, MemoryError):
    """onnxruntime could not allocate a buffer of the step (the message names the segment, the
    memory limit in force and what to do)."""


class LaunchError(NgdistError):
    """A rank of ``ngdist.launch`` failed (the message names the rank and its error), or the
    function cannot be sent to the ranks. ``rank``: the rank that failed, when one did;
    ``remote_traceback``: its traceback, as text."""

    rank: int | None = None
    remote_traceback: str | None = None
