"""``ngdist.compile(..., log_dir=)`` and ``Trainer.evaluate``: the library side of the metrics.

Oracles: each rank's own step losses (the CSV holds their mean), the saved model run by a plain
onnxruntime session with numpy's cross-entropy and accuracy, numpy's squared error, exact
messages. The missing-extras path hides tensorboard and matplotlib from the import system.
"""
from __future__ import annotations

import csv
import logging
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import ngdist
from ngdist import zoo
from ngdist.data import load_digits
from ngdist.errors import InputError, OptionError

RANK_SCRIPT = """
import json, sys
import numpy as np
import ngdist
from ngdist import zoo
from ngdist.data import load_digits

strategy, log_every = sys.argv[1], int(sys.argv[2])
extra = {"servers": 1} if strategy == "ps" else {}
x, y, x_val, y_val = load_digits()
tr = ngdist.compile(zoo.mlp((64, 16, 10), seed=0), optimizer=ngdist.optim.SGD(lr=0.1),
                    strategy=strategy, log_dir="logs", log_every=log_every, **extra)
losses, batch = [], 30 * tr.num_workers + 1  # uneven shards
for epoch in (1, 2):
    tr.set_epoch(epoch)
    for s in range(4):
        start = (epoch * 4 + s) * batch
        for b in tr.shard([{"x": x[start:start + batch], "y": y[start:start + batch]}]):
            losses.append(tr.step(b).loss)
    result = tr.evaluate({"x": x_val, "y": y_val})
    if tr.role == "worker":
        with open(f"eval.{tr.rank}.{epoch}.json", "w") as fh:
            json.dump([result.loss, result.accuracy, result.samples], fh)
np.save(f"losses.{tr.rank}.npy", np.array(losses, np.float64))
if tr.rank == 0:
    tr.save("trained.onnx")
tr.close()
"""


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - logits.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]


@pytest.mark.mpi
@pytest.mark.parametrize("strategy, n, workers, log_every", [
    ("allreduce", 2, 2, 3),
    ("ps", 3, 2, 1),  # a dedicated server rank: the metrics are the two workers'
])
def test_csv_loss_is_the_mean_of_the_ranks_and_evaluate_is_the_whole_set(
        ranks, tmp_path, strategy, n, workers, log_every):
    import json

    ranks(n, RANK_SCRIPT, args=[strategy, str(log_every)], timeout=180,
          env={"NGDIST_TIMEOUT": "60"})
    own = np.stack([np.load(tmp_path / f"losses.{r}.npy") for r in range(workers)])
    assert own.shape == (workers, 8)
    assert not np.array_equal(own[0], own[1])  # the shards differ, so the mean is not rank 0's
    rows = read_csv(tmp_path / "logs" / "metrics.csv")
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    assert [r["split"] for r in rows] == ["train"] * 4 + ["val"] + ["train"] * 4 + ["val"]
    assert [int(r["step"]) for r in train] == list(range(1, 9))
    assert [int(r["epoch"]) for r in train] == [1] * 4 + [2] * 4
    np.testing.assert_allclose([float(r["loss"]) for r in train], own.mean(axis=0),
                               rtol=1e-15, atol=0)
    assert all(int(r["samples"]) == 30 * workers + 1 for r in train)

    _, _, x_val, y_val = load_digits()
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"),
                                providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"x": x_val})[0]
    accuracy = float((logits.argmax(1) == y_val).mean())
    results = [json.loads((tmp_path / f"eval.{r}.2.json").read_text()) for r in range(workers)]
    assert all(res == results[0] for res in results)  # the same numbers on every rank
    loss, acc, samples = results[0]
    assert (acc, samples) == (accuracy, len(y_val))  # 359 samples: uneven shards, exact counts
    assert loss == pytest.approx(cross_entropy(logits, y_val).mean(), rel=1e-6)
    assert (float(val[-1]["loss"]), float(val[-1]["accuracy"]), int(val[-1]["samples"])) == \
        (loss, acc, samples)
    assert (tmp_path / "logs" / "metrics.png").stat().st_size > 20_000


def _train_a_little(tr: ngdist.Trainer, steps: int = 5) -> None:
    x, y, _, _ = load_digits()
    for s in range(steps):
        tr.step({"x": x[s * 32:(s + 1) * 32], "y": y[s * 32:(s + 1) * 32]})


def test_without_the_extras_only_the_csv_is_written_and_one_line_says_why(tmp_path, monkeypatch,
                                                                           caplog):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # import fails as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING, logger="ngdist"):
        tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1),
                            log_dir=tmp_path / "logs", log_every=2)
        _train_a_little(tr)
        tr.close()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["metrics.csv"]
    assert len(read_csv(tmp_path / "logs" / "metrics.csv")) == 5  # the odd step flushed at close
    hints = [r.getMessage() for r in caplog.records if "ngdist[metrics]" in r.getMessage()]
    assert hints == [f"metrics: TensorBoard event files and the PNG of the curves need pip "
                     f"install 'ngdist[metrics]' (missing: tensorboard, matplotlib); writing "
                     f"{tmp_path / 'logs' / 'metrics.csv'} only"]


def test_evaluate_mse_is_the_mean_squared_error_without_accuracy():
    x, y, x_val, y_val = load_digits()
    onehot = np.eye(10, dtype=np.float32)
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), loss="mse", optimizer=ngdist.optim.SGD(lr=0.1))
    tr.step({"x": x[:32], "y": onehot[y[:32]]})
    result = tr.evaluate({"x": x_val, "y": onehot[y_val]}, batch_size=100)
    out = tr.predict({"x": x_val})[0].astype(np.float64)
    assert result.accuracy is None and result.samples == len(y_val)
    assert result.loss == pytest.approx(np.mean((out - onehot[y_val]) ** 2), rel=1e-12)


def test_evaluate_names_what_it_needs():
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1))
    with pytest.raises(InputError, match=r"^evaluate\(\) needs arrays \['x', 'y'\]; \['y'\] "
                                         r"missing$"):
        tr.evaluate({"x": np.zeros((4, 64), np.float32)})


def test_log_dir_with_metrics_and_bad_log_every_are_refused(tmp_path):
    (tmp_path / "metrics.csv").write_text("old\n")
    with pytest.raises(InputError) as err:
        ngdist.compile(zoo.mlp((64, 8, 10)), log_dir=tmp_path, optimizer="sgd:lr=0.01")
    assert str(err.value) == (f"{tmp_path / 'metrics.csv'} already exists: each run writes its "
                              "own metrics; give another log directory (--log-dir, log_dir=) or "
                              "remove the old file")
    assert (tmp_path / "metrics.csv").read_text() == "old\n"
    with pytest.raises(InputError, match=r"^log_every must be a whole number of steps, at least "
                                         r"1; got 0$"):
        ngdist.compile(zoo.mlp((64, 8, 10)), log_dir=tmp_path / "new", log_every=0,
                       optimizer="sgd:lr=0.01")
    with pytest.raises(OptionError, match="option 'log_every' of ngdist.compile takes"):
        ngdist.compile(zoo.mlp((64, 8, 10)), log_dir=tmp_path / "new", log_every="3",
                       optimizer="sgd:lr=0.01")


def test_evaluate_a_model_that_computes_its_own_loss_matches_onnxruntime_loss():
    """The scores of the loss are inside the graph (not an output): evaluate adds them as an
    output; onnxruntime's own SoftmaxCrossEntropyLoss over the whole set is the oracle."""
    from onnx import TensorProto, helper

    model = zoo.mlp((64, 8, 10))
    g = model.graph
    g.input.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["batch"]))
    g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"],
                                   reduction="mean"))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    x, y, x_val, y_val = load_digits()
    tr = ngdist.compile(model, loss=None, optimizer=ngdist.optim.SGD(lr=0.1))
    _train_a_little(tr, 3)
    result = tr.evaluate({"x": x_val, "y": y_val}, batch_size=64)
    sess = ort.InferenceSession(tr.inference_model().SerializeToString(),
                                providers=["CPUExecutionProvider"])
    assert result.loss == pytest.approx(float(sess.run(None, {"x": x_val, "y": y_val})[0]),
                                        rel=1e-6)
    assert result.accuracy is not None and 0 <= result.accuracy <= 1


def test_evaluate_refuses_labels_out_of_range_and_a_bad_batch_size():
    _, _, x_val, y_val = load_digits()
    tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1))
    with pytest.raises(InputError, match=r"^labels 'y' of softmax_cross_entropy hold 10 \(flat "
                                         r"index \d+\), but the model's output 'logits' has 10 "
                                         r"classes"):
        tr.evaluate({"x": x_val, "y": np.where(y_val == 3, 10, y_val)})
    with pytest.raises(InputError, match=r"^evaluate\(batch_size=0\): give a whole number of "
                                         r"samples, at least 1$"):
        tr.evaluate({"x": x_val, "y": y_val}, batch_size=0)


def test_a_job_resumed_from_a_checkpoint_goes_on_in_the_same_metrics_csv(tmp_path):
    """The first run checkpoints at step 4 and logs 5 steps; a second run from the same
    checkpoint folder resumes at step 4 and appends its steps 5..7 under the same header."""
    logs, ckpt = tmp_path / "logs", tmp_path / "ckpt"

    def run(steps: int) -> ngdist.Trainer:
        tr = ngdist.compile(zoo.mlp((64, 8, 10)), optimizer=ngdist.optim.SGD(lr=0.1),
                            log_dir=logs, log_every=1, checkpoint_every=4, checkpoint_dir=ckpt)
        x, y, _, _ = load_digits()
        for s in range(tr.resumed_from, steps):
            tr.step({"x": x[s * 32:(s + 1) * 32], "y": y[s * 32:(s + 1) * 32]})
        tr.close()
        return tr

    assert run(5).resumed_from == 0
    assert run(7).resumed_from == 4
    rows = read_csv(logs / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5, 5, 6, 7]
    assert (logs / "metrics.csv").read_text().count("step,epoch,split") == 1
