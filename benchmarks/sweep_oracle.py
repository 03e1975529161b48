"""The model sweep's torch oracle (benchmarks/sweep_check.py): torch autograd and torch's
optimizer step in float64 (the reference) and in float32 (torch's own error), run in a forked
child process (``Oracle``).

torch's own float32 error of a tensor is the largest over ``TORCH32_RUNS``, a fixed set of
equally valid float32 runs of torch on the same model and batch: one sample of it can be
small for a tensor by luck where the model is ill-conditioned in float32 (a ReLU input within
rounding of 0 takes one side in one run, the other side in the next):

* ``default``: torch as configured (oneDNN convolutions, one thread);
* ``no_mkldnn``: ``torch.backends.mkldnn.flags(enabled=False)`` (torch's own im2col
  convolutions: another summation order);
* ``channels_last``: the module and its 4-D inputs in channels-last memory format (only where
  the model has a 4-D parameter);
* ``two_threads``: ``torch.set_num_threads(2)`` (reductions split across threads);
* ``input_ulp``: every float input that holds non-integer values moved by one ulp per
  entry, up or down at random (seed 0): the batch as float32 knows it (only where there is
  one: token ids and 0/1 masks are exact).

The bound only widens: the largest over the runs includes ``default``. The other runs are
taken only where a tensor is out of bounds against ``default`` alone (the same child, from
the same state), so a model that passes on it costs one float32 run a stage. What each run adds is recorded per row (``grad_spread``, ``sgd_spread``,
``adamw_spread``: the tensor nearest its bound against ``default`` alone, with every run's
error of it).
"""
from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import numpy as np

TORCH32_RUNS = ("default", "no_mkldnn", "channels_last", "two_threads", "input_ulp")


class StageError(Exception):
    """A check that did not hold: the stage and what differed."""


def tensors_of(feeds: dict[str, np.ndarray], float64: bool = False) -> list[Any]:
    import torch

    return [torch.from_numpy(v.astype(np.float64) if float64 and v.dtype.kind == "f" else v)
            for v in feeds.values()]


def loss_of(module: Any, loss_fn: Any, tensors: list[Any]) -> Any:
    """``loss_fn(module(*inputs), y)``, or ``module(*inputs, y)`` where the module returns its
    loss (``loss_fn`` None: the labels are the module's last input)."""
    return module(*tensors) if loss_fn is None else loss_fn(module(*tensors[:-1]), tensors[-1])


def to_float64(module: Any) -> Any:
    """``module.double()``, its Hugging Face mixture-of-experts layers on the "eager" experts
    implementation (one matmul an expert; the same function): torch's grouped_mm kernel takes
    no float64."""
    module.double()
    for sub in module.modules():
        cfg = getattr(sub, "config", None)
        if getattr(cfg, "_experts_implementation", None) not in (None, "eager"):
            cfg._experts_implementation = "eager"
    return module


def float32_runs(module: Any, feeds: dict[str, np.ndarray]) -> tuple[str, ...]:
    """The runs of ``TORCH32_RUNS`` that can differ from ``default`` for ``module`` on
    ``feeds``: ``channels_last`` where it has a 4-D parameter, ``input_ulp`` where a float
    input holds a non-integer value."""
    four_d = any(p.dim() == 4 for p in module.parameters())
    nudged = any(v.dtype.kind == "f" and not np.array_equal(v, np.round(v))
                 for v in feeds.values())
    return tuple(r for r in TORCH32_RUNS if (r != "channels_last" or four_d)
                 and (r != "input_ulp" or nudged))


def _nudged(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each float input that holds a non-integer value moved by one ulp per entry, up or down
    (seed 0); masks and other integer-valued inputs stay as they are."""
    rng = np.random.default_rng(0)
    out = {}
    for k, v in feeds.items():
        if v.dtype.kind == "f" and not np.array_equal(v, np.round(v)):
            v = np.nextafter(v, np.where(rng.random(v.shape) < 0.5, -np.inf, np.inf
                                         ).astype(v.dtype))
        out[k] = v
    return out


@contextlib.contextmanager
def float32_run(run: str, module: Any, feeds: dict[str, np.ndarray]
                ) -> Iterator[tuple[Any, list[Any]]]:
    """(module, input tensors) for torch float32 run ``run`` of ``TORCH32_RUNS``, torch's
    settings for it in force inside the block. ``module`` is changed in place (a copy)."""
    import torch

    if run not in TORCH32_RUNS:
        raise ValueError(f"unknown torch float32 run {run!r}; one of {TORCH32_RUNS}")
    tensors = tensors_of(_nudged(feeds) if run == "input_ulp" else feeds)
    if run == "channels_last":
        module.to(memory_format=torch.channels_last)
        tensors = [t.contiguous(memory_format=torch.channels_last)
                   if t.dim() == 4 and t.is_floating_point() else t for t in tensors]
    threads = torch.get_num_threads()
    with (torch.backends.mkldnn.flags(enabled=False) if run == "no_mkldnn"
          else contextlib.nullcontext()):
        try:
            if run == "two_threads":
                torch.set_num_threads(2)
            yield module, tensors
        finally:
            torch.set_num_threads(threads)


def torch_grads(module: Any, feeds: dict[str, np.ndarray], loss_fn: Any, float64: bool,
                run: str = "default") -> tuple[float, dict[str, np.ndarray]]:
    """(loss, {parameter: gradient in float64}) of torch autograd on a copy of ``module``:
    in float64, or float32 run ``run``."""
    ref = copy.deepcopy(module)
    if float64:
        to_float64(ref)
        loss = loss_of(ref, loss_fn, tensors_of(feeds, True))
        loss.backward()
    else:
        with float32_run(run, ref, feeds) as (ref, tensors):
            loss = loss_of(ref, loss_fn, tensors)
            loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().astype(np.float64)
                                  for n, p in ref.named_parameters() if p.grad is not None}


def state_of(module: Any) -> dict[str, np.ndarray]:
    """The module's float parameters and buffers, copied in their own type (a float32 state
    is kept in float32, exactly: the comparisons take one tensor to float64 at a time)."""
    return {k: v.detach().numpy().copy() for k, v in module.state_dict().items()
            if v.is_floating_point()}


def torch_step(module: Any, optimizer: Any, feeds: dict[str, np.ndarray], loss_fn: Any,
               make_opt: Any, float64: bool, run: str = "default") -> dict[str, np.ndarray]:
    """The state after one torch step from ``module``'s state and ``optimizer``'s (its
    moments and step count, cast to the copy's type by ``load_state_dict``): in float64, or
    float32 run ``run``."""
    ref = copy.deepcopy(module)
    if float64:
        to_float64(ref)
        context = contextlib.nullcontext((ref, tensors_of(feeds, True)))
    else:
        context = float32_run(run, ref, feeds)
    with context as (ref, tensors):
        opt = make_opt(ref.parameters())
        # a copy: load_state_dict keeps a float32 moment as the very tensor (no cast needed),
        # which this step would then update in place for the next run from the same state
        opt.load_state_dict(copy.deepcopy(optimizer.state_dict()))
        opt.zero_grad()
        loss_of(ref, loss_fn, tensors).backward()
        opt.step()
    return {k: np.ascontiguousarray(v) for k, v in state_of(ref).items()}


class Oracle:
    """``fn(runs)`` (a dict of numbers and of dicts of arrays) computed in a forked child
    process for each tuple of torch float32 runs the parent asks for (``ask``), the child
    seeing this process's modules and optimizer as they were when it was forked
    (copy-on-write) however the parent changes them in between, and sending each result back
    one array at a time: the torch oracle's float64 model copies, optimizer state,
    activations and gradients live and die there, so the sweep's process (its resident size
    is what the 8 GiB cap measures) holds ngdist and the model, not the oracle. ``fn`` may
    keep what later asks reuse (the float64 reference) in a closure: the child is one
    process."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn

    def __enter__(self) -> Oracle:
        import multiprocessing

        context = multiprocessing.get_context("fork")
        self._receive, send = context.Pipe(duplex=False)
        asked, self._ask = context.Pipe(duplex=False)

        def child() -> None:
            while (runs := asked.recv()) is not None:
                try:
                    for key, value in self.fn(runs).items():
                        send.send((key, isinstance(value, dict), None, None if
                                   isinstance(value, dict) else value))
                        for name, array in (value.items() if isinstance(value, dict) else ()):
                            send.send((key, True, name, array))
                except BaseException as exc:  # noqa: BLE001 - the parent raises it
                    send.send(("error", False, None, f"{type(exc).__name__}: {exc}"))
                send.send(None)
            send.close()

        self._proc = context.Process(target=child)
        self._proc.start()
        send.close()
        asked.close()
        return self

    def ask(self, runs: tuple[str, ...]) -> dict[str, Any]:
        self._ask.send(tuple(runs))
        out: dict[str, Any] = {}
        try:
            while (item := self._receive.recv()) is not None:
                key, nested, name, value = item
                if nested:
                    out.setdefault(key, {})
                    if name is not None:
                        out[key][name] = value
                else:
                    out[key] = value
        except EOFError:
            self._proc.join()
            raise StageError(f"the torch oracle's process ended without a result (exit "
                             f"code {self._proc.exitcode})") from None
        if "error" in out:
            raise RuntimeError(f"in the torch oracle: {out['error']}")
        return out

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self._ask.send(None)
        self._ask.close()
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


def forked(fn: Any) -> dict[str, Any]:
    """``fn()`` computed once by an ``Oracle``'s forked child."""
    with Oracle(lambda runs: fn()) as oracle:
        return oracle.ask(())
