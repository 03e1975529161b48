"""LSTM, GRU and RNN against central differences (the harness of ``grad_harness``; float64 on
ONNX's reference evaluator, onnxruntime has no float64 kernels for them): directions, biases,
initial states, every output in the loss or only some; refused forms are named."""
from __future__ import annotations

import pytest
from onnx import helper

from grad_harness import case, check_case, lowering_error

T, B, I, H = 3, 2, 3, 2


def _rnn(cid: str, op: str, direction: str = "forward", bias: bool = True,
         initial: bool = True, used=(0, 1), **attrs):
    gates, dirs = {"LSTM": 4, "GRU": 3, "RNN": 1}[op], (2 if direction == "bidirectional" else 1)
    n_out = 3 if op == "LSTM" else 2
    if op == "GRU":
        attrs.setdefault("linear_before_reset", 1)

    def make(g):
        ins = [g.n(T, B, I), g.n(dirs, gates * H, I) * 0.6, g.n(dirs, gates * H, H) * 0.6,
               g.n(dirs, 2 * gates * H) * 0.5 if bias else None, None]
        if initial:
            ins += [g.n(dirs, B, H) * 0.5] + ([g.n(dirs, B, H) * 0.5] if op == "LSTM" else [])
        while ins[-1] is None:
            ins.pop()
        return ins

    return case(cid, op, make, n_out=n_out, used=list(used), hidden_size=H,
                direction=direction, reference=True, **attrs)


CASES = [
    _rnn("LSTM-forward", "LSTM", used=(0, 1, 2)),
    _rnn("LSTM-reverse-Y-only", "LSTM", "reverse", used=(0,)),
    _rnn("LSTM-bidirectional", "LSTM", "bidirectional", used=(0, 1, 2)),
    _rnn("LSTM-no-bias-no-initial-Yh-only", "LSTM", bias=False, initial=False, used=(1,)),
    _rnn("LSTM-Yc-only", "LSTM", used=(2,)),
    _rnn("GRU-forward", "GRU"),
    _rnn("GRU-reverse", "GRU", "reverse"),
    _rnn("GRU-bidirectional", "GRU", "bidirectional"),
    _rnn("GRU-no-bias-no-initial", "GRU", bias=False, initial=False, used=(0,)),
    _rnn("RNN-tanh-bidirectional", "RNN", "bidirectional"),
    # (a relu RNN: onnx 1.23's reference RNN knows only tanh; tests/passes/autodiff/
    # test_grad_torch_ops.py checks nn.RNN(nonlinearity="relu") against torch)
    _rnn("RNN-no-bias-Yh-only", "RNN", bias=False, used=(1,)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rule_matches_central_differences(case) -> None:
    check_case(case)


def test_gru_without_linear_before_reset_is_refused_naming_the_node() -> None:
    nodes = [helper.make_node("Constant", [], ["w"], name="w0", value=helper.make_tensor(
                 "w", 1, [1, 6, 3], [0.1] * 18)),
             helper.make_node("Constant", [], ["r"], name="r0", value=helper.make_tensor(
                 "r", 1, [1, 6, 2], [0.1] * 12)),
             helper.make_node("GRU", ["x", "w", "r"], ["y"], name="gru0", hidden_size=2)]
    assert lowering_error(nodes, [3, 2, 3]) == (
        "gradient rule of GRU failed on node 'gru0': GRU 'gru0' with linear_before_reset=0 is "
        "not differentiated; export the layer without them (nn.LSTM / nn.GRU defaults, "
        "batch-first inputs transposed)")
