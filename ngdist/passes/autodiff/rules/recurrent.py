"""Recurrent layers: LSTM, GRU and RNN (what nn.LSTM / nn.GRU / nn.RNN export; RNN with tanh
or relu), forward, reverse and bidirectional, with biases and initial states.

Nothing is re-run step by step that the forward node already returned: every step's previous
hidden state is the node's own output Y shifted by one step (the initial state first), so all
gate pre-activations come from two MatMuls over the whole sequence. Only the LSTM's cell
states are rebuilt step by step (two elementwise ops a step), and back-propagation through
time is unrolled over the static sequence length: per step a few elementwise ops and one
MatMul with R; the weight gradients are one Gemm each over all steps. A reverse direction is
the forward computation on the time-reversed sequence.

Refused (naming the op, node and form): sequence_lens, layout=1, clip, input_forget,
peepholes, activations other than the defaults, GRU's linear_before_reset=0, and a sequence
length known only at run time.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ngdist.passes.autodiff.registry import GradContext, attr, register
from ngdist.passes.autodiff.rules._common import ensure_output

_DEFAULT_ACTS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}


def _check(node: ir.Node) -> tuple[int, int]:
    """(sequence length, number of directions) of a form the rules differentiate."""
    op, what = node.op_type, f"{node.op_type} '{node.name}'"
    inputs = list(node.inputs) + [None] * 8
    refused = [("sequence_lens", inputs[4] is not None), ("layout=1", attr(node, "layout", 0)),
               ("clip", attr(node, "clip") is not None),
               ("input_forget", attr(node, "input_forget", 0)),
               ("peepholes", op == "LSTM" and inputs[7] is not None),
               ("linear_before_reset=0", op == "GRU" and not attr(node, "linear_before_reset", 0))]
    acts = attr(node, "activations")
    dirs = 2 if attr(node, "direction", "forward") == "bidirectional" else 1
    names = None if acts is None else [a.decode() if isinstance(a, bytes) else a for a in acts]
    if names is not None and names != _DEFAULT_ACTS[op] * dirs and \
            not (op == "RNN" and names == ["Relu"] * dirs):
        refused.append((f"activations {list(acts)}", True))
    bad = [name for name, hit in refused if hit]
    if bad:
        raise ValueError(f"{what} with {', '.join(bad)} is not differentiated; export the layer "
                         "without them (nn.LSTM / nn.GRU defaults, batch-first inputs transposed)")
    x = node.inputs[0]
    steps = x.shape.dims[0] if x.shape is not None and x.shape.rank() == 3 else None
    if not isinstance(steps, int):
        raise ValueError(f"{what}: its sequence length is known only at run time; the gradient "
                         "unrolls it and needs it static (export with a fixed sequence length)")
    return steps, dirs


def _flip(ctx: GradContext, v: ir.Value, steps: int) -> ir.Value:
    return ctx.op("Slice", v, ctx.ints([steps - 1]), ctx.ints([-steps - 1]), ctx.ints([0]),
                  ctx.ints([-1]))


def _split(ctx: GradContext, v: ir.Value, sizes: list[int], axis: int) -> list[ir.Value]:
    if len(sizes) == 1:
        return [v]
    return list(ctx.op_multi("Split", v, ctx.ints(sizes), axis=axis, num_outputs=len(sizes)))


def _steps(ctx: GradContext, v: ir.Value, steps: int) -> list[ir.Value]:
    return _split(ctx, v, [1] * steps, 0)


def _pick(ctx: GradContext, v: ir.Value | None, d: int, axis: int = 0) -> ir.Value | None:
    return None if v is None else ctx.op("Gather", v, ctx.const(np.array(d, np.int64)), axis=axis)


class _Direction:
    """One direction's values in processing order (time-reversed for a reverse direction)."""

    def __init__(self, ctx: GradContext, node: ir.Node, d: int, steps: int, reverse: bool):
        x, w, r = node.inputs[:3]
        inputs = list(node.inputs) + [None] * 8
        gates, hidden = _GATES[node.op_type], attr(node, "hidden_size")
        self.ctx, self.steps, self.reverse, self.hidden = ctx, steps, reverse, hidden
        self.x = _flip(ctx, x, steps) if reverse else x                     # [T, B, I]
        self.w, self.r = _pick(ctx, w, d), _pick(ctx, r, d)                 # [G H, I], [G H, H]
        bias = _pick(ctx, inputs[3], d)
        self.wb = self.rb = None
        if bias is not None:
            self.wb, self.rb = _split(ctx, bias, [gates * hidden] * 2, 0)
        y = _pick(ctx, ensure_output(node, 0, "Y"), d, axis=1)              # [T, B, H]
        self.y = _flip(ctx, y, steps) if reverse else y
        batch_h = ctx.op("Concat", ctx.op("Shape", x, start=1, end=2), ctx.ints([hidden]),
                         axis=0)
        self.zero_h = ctx.op("CastLike", ctx.op("ConstantOfShape", batch_h,
                                                value=ir.tensor(np.zeros(1, np.float32))), x)
        self.h0 = _pick(ctx, inputs[5], d) if inputs[5] is not None else self.zero_h
        self.c0 = _pick(ctx, inputs[6], d) if node.op_type == "LSTM" and \
            inputs[6] is not None else self.zero_h
        first = ctx.op("Unsqueeze", self.h0, ctx.ints([0]))
        self.hprev = first if steps == 1 else ctx.op("Concat", first, ctx.op(
            "Slice", self.y, ctx.ints([0]), ctx.ints([steps - 1]), ctx.ints([0])), axis=0)
        self.gates = gates

    def time(self, v: ir.Value) -> ir.Value:
        """A [T, ...] gradient in processing order back to the input's order."""
        return _flip(self.ctx, v, self.steps) if self.reverse else v

    def grads(self, dz_x: ir.Value, dz_r: ir.Value, r_in: ir.Value) -> list[ir.Value]:
        """dX [T, B, I] (input order), dW, dR, dB of this direction from the pre-activation
        gradients of the input projection ``dz_x`` and of the recurrent one ``dz_r`` (with
        ``r_in``, what R multiplied), all [T, B, G H]."""
        ctx = self.ctx
        width = ctx.ints([-1, self.gates * self.hidden])
        rows_x, rows_r = ctx.op("Reshape", dz_x, width), ctx.op("Reshape", dz_r, width)
        flat = lambda v: ctx.op("Reshape", v, ctx.op("Concat", ctx.ints([-1]),  # noqa: E731
                                                     ctx.op("Shape", v, start=2), axis=0))
        dx = self.time(ctx.op("MatMul", dz_x, self.w))
        dw = ctx.op("Gemm", rows_x, flat(self.x), transA=1)
        dr = ctx.op("Gemm", rows_r, flat(r_in), transA=1)
        zero = ctx.ints([0])
        db = ctx.op("Concat", ctx.op("ReduceSum", rows_x, zero, keepdims=0),
                    ctx.op("ReduceSum", rows_r, zero, keepdims=0), axis=0)
        return [dx, dw, dr, db]


def _total(ctx, parts, dirn: _Direction) -> ir.Value:
    """The sum of the gradients that reach one step's hidden state (zeros if none does)."""
    parts = [v for v in parts if v is not None]
    if not parts:
        return ctx.op("Unsqueeze", dirn.zero_h, ctx.ints([0]))
    return parts[0] if len(parts) == 1 else ctx.op("Sum", *parts)


def _sig_grad(ctx, d, s):
    """d * s (1 - s): through a sigmoid whose output is s."""
    return ctx.op("Mul", d, ctx.op("Mul", s, ctx.op("Sub", ctx.scalar(1.0, s), s)))


def _tanh_grad(ctx, d, t):
    return ctx.op("Mul", d, ctx.op("Sub", ctx.scalar(1.0, t), ctx.op("Mul", t, t)))


def _lstm_direction(ctx, dirn: _Direction, gy, gyh, gyc):
    """(dX, dW, dR, dB, dh0, dc0) of one LSTM direction (gates i, o, f, c)."""
    z = ctx.op("Add", ctx.op("MatMul", dirn.x, ctx.op("Transpose", dirn.w, perm=[1, 0])),
               ctx.op("MatMul", dirn.hprev, ctx.op("Transpose", dirn.r, perm=[1, 0])))
    if dirn.wb is not None:
        z = ctx.op("Add", z, ctx.op("Add", dirn.wb, dirn.rb))
    zi, zo, zf, zc = _split(ctx, z, [dirn.hidden] * 4, -1)
    i, o, f = (ctx.op("Sigmoid", v) for v in (zi, zo, zf))
    cc = ctx.op("Tanh", zc)
    steps = dirn.steps
    i_t, o_t, f_t, cc_t = (_steps(ctx, v, steps) for v in (i, o, f, cc))
    cells, c = [], ctx.op("Unsqueeze", dirn.c0, ctx.ints([0]))
    for t in range(steps):  # the cell states: the one recurrence Y does not give
        cells.append(c)
        c = ctx.op("Add", ctx.op("Mul", f_t[t], c), ctx.op("Mul", i_t[t], cc_t[t]))
    cells.append(c)
    gy_t = _steps(ctx, gy, steps) if gy is not None else [None] * steps
    dh, dc, dz = None, None, [None] * steps
    for t in reversed(range(steps)):
        dh_t = _total(ctx, [gy_t[t], dh, gyh if t == steps - 1 else None], dirn)
        tc = ctx.op("Tanh", cells[t + 1])
        dc_parts = [_tanh_grad(ctx, ctx.op("Mul", dh_t, o_t[t]), tc)]
        dc_parts += [v for v in (dc, gyc if t == steps - 1 else None) if v is not None]
        dc_t = dc_parts[0] if len(dc_parts) == 1 else ctx.op("Sum", *dc_parts)
        dz[t] = ctx.op("Concat", _sig_grad(ctx, ctx.op("Mul", dc_t, cc_t[t]), i_t[t]),
                       _sig_grad(ctx, ctx.op("Mul", dh_t, tc), o_t[t]),
                       _sig_grad(ctx, ctx.op("Mul", dc_t, cells[t]), f_t[t]),
                       _tanh_grad(ctx, ctx.op("Mul", dc_t, i_t[t]), cc_t[t]), axis=-1)
        dh, dc = ctx.op("MatMul", dz[t], dirn.r), ctx.op("Mul", dc_t, f_t[t])
    dz_all = dz[0] if steps == 1 else ctx.op("Concat", *dz, axis=0)
    squeeze = ctx.ints([0])
    return [*dirn.grads(dz_all, dz_all, dirn.hprev), ctx.op("Squeeze", dh, squeeze),
            ctx.op("Squeeze", dc, squeeze)]


def _gru_direction(ctx, dirn: _Direction, gy, gyh, _gyc):
    """(dX, dW, dR, dB, dh0, None) of one GRU direction (gates z, r, h;
    linear_before_reset=1: h~ = tanh(x Wh + r * (h Rh + Rbh) + Wbh))."""
    xw = ctx.op("MatMul", dirn.x, ctx.op("Transpose", dirn.w, perm=[1, 0]))
    hr = ctx.op("MatMul", dirn.hprev, ctx.op("Transpose", dirn.r, perm=[1, 0]))
    if dirn.wb is not None:
        xw, hr = ctx.op("Add", xw, dirn.wb), ctx.op("Add", hr, dirn.rb)
    xz, xr, xh = _split(ctx, xw, [dirn.hidden] * 3, -1)
    hz, hrr, u = _split(ctx, hr, [dirn.hidden] * 3, -1)
    z, r = ctx.op("Sigmoid", ctx.op("Add", xz, hz)), ctx.op("Sigmoid", ctx.op("Add", xr, hrr))
    hh = ctx.op("Tanh", ctx.op("Add", xh, ctx.op("Mul", r, u)))
    steps = dirn.steps
    z_t, r_t, hh_t, u_t, hp_t = (_steps(ctx, v, steps) for v in (z, r, hh, u, dirn.hprev))
    gy_t = _steps(ctx, gy, steps) if gy is not None else [None] * steps
    dh, dzx, dzr = None, [None] * steps, [None] * steps
    for t in reversed(range(steps)):
        dh_t = _total(ctx, [gy_t[t], dh, gyh if t == steps - 1 else None], dirn)
        dzz = _sig_grad(ctx, ctx.op("Mul", dh_t, ctx.op("Sub", hp_t[t], hh_t[t])), z_t[t])
        dzh = _tanh_grad(ctx, ctx.op("Mul", dh_t, ctx.op("Sub", ctx.scalar(1.0, z_t[t]),
                                                         z_t[t])), hh_t[t])
        dzr_ = _sig_grad(ctx, ctx.op("Mul", dzh, u_t[t]), r_t[t])
        du = ctx.op("Mul", dzh, r_t[t])
        dzx[t] = ctx.op("Concat", dzz, dzr_, dzh, axis=-1)
        dzr[t] = ctx.op("Concat", dzz, dzr_, du, axis=-1)
        dh = ctx.op("Add", ctx.op("Mul", dh_t, z_t[t]), ctx.op("MatMul", dzr[t], dirn.r))
    cat = (lambda vs: vs[0]) if steps == 1 else (lambda vs: ctx.op("Concat", *vs, axis=0))
    return [*dirn.grads(cat(dzx), cat(dzr), dirn.hprev),
            ctx.op("Squeeze", dh, ctx.ints([0])), None]


def _rnn_direction(ctx, dirn: _Direction, gy, gyh, _gyc, relu: bool = False):
    """(dX, dW, dR, dB, dh0, None) of one RNN direction: h = act(x W + h R + b) is Y itself."""
    steps = dirn.steps
    y_t = _steps(ctx, dirn.y, steps)
    gy_t = _steps(ctx, gy, steps) if gy is not None else [None] * steps
    dh, dz = None, [None] * steps
    for t in reversed(range(steps)):
        dh_t = _total(ctx, [gy_t[t], dh, gyh if t == steps - 1 else None], dirn)
        dz[t] = ctx.op("Mul", dh_t, ctx.op("CastLike", ctx.op(
            "Greater", y_t[t], ctx.scalar(0.0, y_t[t])), y_t[t])) if relu else \
            _tanh_grad(ctx, dh_t, y_t[t])
        dh = ctx.op("MatMul", dz[t], dirn.r)
    dz_all = dz[0] if steps == 1 else ctx.op("Concat", *dz, axis=0)
    return [*dirn.grads(dz_all, dz_all, dirn.hprev), ctx.op("Squeeze", dh, ctx.ints([0])),
            None]


def _relu_rnn_direction(ctx, dirn, gy, gyh, gyc):
    return _rnn_direction(ctx, dirn, gy, gyh, gyc, relu=True)


@register("LSTM", "GRU", "RNN")
def recurrent(ctx, node, gys):
    steps, dirs = _check(node)
    gys = list(gys) + [None] * 3
    reverse_only = attr(node, "direction", "forward") == "reverse"
    per_dir = []
    for d in range(dirs):
        reverse = reverse_only or d == 1
        dirn = _Direction(ctx, node, d, steps, reverse)
        gy = _pick(ctx, gys[0], d, axis=1)
        if gy is not None and reverse:
            gy = _flip(ctx, gy, steps)
        unit = {"LSTM": _lstm_direction, "GRU": _gru_direction, "RNN": _rnn_direction}[
            node.op_type]
        if node.op_type == "RNN" and attr(node, "activations") is not None and \
                attr(node, "activations")[0] in ("Relu", b"Relu"):
            unit = _relu_rnn_direction
        gyh, gyc = (None if v is None else ctx.op("Unsqueeze", _pick(ctx, v, d), ctx.ints([0]))
                    for v in gys[1:3])  # [1, B, H], like one step
        per_dir.append(unit(ctx, dirn, gy, gyh, gyc))
    stack = lambda k: per_dir[0][k] if dirs == 1 and k == 0 else (  # noqa: E731
        ctx.op("Sum", *[p[k] for p in per_dir]) if k == 0 else
        ctx.op("Concat", *[ctx.op("Unsqueeze", p[k], ctx.ints([0])) for p in per_dir], axis=0))
    inputs = list(node.inputs) + [None] * 8
    out = [stack(0), stack(1), stack(2)]
    out.append(stack(3) if inputs[3] is not None else None)
    out.append(None)  # sequence_lens
    out.append(stack(4))
    out.append(stack(5) if node.op_type == "LSTM" else None)
    return out[:len(node.inputs)]
