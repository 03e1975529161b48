"""``ngdist train --log-dir DIR --val-split F`` on 2 ranks: metrics.csv, TensorBoard events, PNG.

Oracles: the loss column against each rank's shard loss recomputed in numpy along a one-process
run fed the same global batches (which follows the 2-rank parameters); the validation rows
against the saved model run by a plain onnxruntime session on the held-out samples; the event
files against the CSV through tensorboard's own reader; exact error messages.
"""
from __future__ import annotations

import csv
import struct
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from ngdist.data import load_digits

from conftest import TRAIN_SAMPLES, ngdist_train

OPTIMIZER = "sgd:lr=0.1,momentum=0.9"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def cross_entropy(logits: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Per-sample softmax cross-entropy in float64 (numpy, independent of ngdist)."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]


def held_out(samples: int, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(training indices, validation indices) as documented for --val-split."""
    perm = np.random.default_rng(0).permutation(samples)
    k = int(round(fraction * samples))
    return np.sort(perm[k:]), np.sort(perm[:k])


@pytest.mark.mpi
def test_log_dir_on_2_ranks_writes_the_mean_loss_validation_events_and_png(train_files):
    epochs, batch = 2, 16
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "digits.npz", "-n", "2", "--epochs",
                        str(epochs), "--batch-size", str(batch), "--optimizer", OPTIMIZER,
                        "--val-split", "0.25", "--log-dir", "logs", "--log-every", "4",
                        "--save", "two.onnx")
    assert proc.returncode == 0, proc.stderr
    logs = train_files / "logs"
    names = sorted(p.name for p in logs.iterdir())
    assert {"metrics.csv", "metrics.png", "rank.0.log"} <= set(names)
    assert len([n for n in names if n.startswith("events.out.tfevents.")]) == 1, names
    rows = read_csv(logs / "metrics.csv")
    train = [r for r in rows if r["split"] == "train"]
    val = [r for r in rows if r["split"] == "val"]
    steps_per_epoch = 480 // (2 * batch)  # 160 of the 640 samples held out
    assert [int(r["step"]) for r in train] == list(range(1, epochs * steps_per_epoch + 1))
    assert [int(r["epoch"]) for r in train] == \
        [1 + i // steps_per_epoch for i in range(epochs * steps_per_epoch)]
    assert [(int(r["step"]), int(r["epoch"]), int(r["samples"])) for r in val] == \
        [(steps_per_epoch * (e + 1), e + 1, 160) for e in range(epochs)]
    assert all(int(r["samples"]) == 2 * batch for r in train)
    for r in train:
        times = [float(r[k]) for k in ("step_time_s", "compute_s", "comm_s", "wait_s")]
        assert all(t >= 0 for t in times) and times[0] > 0, r
        assert float(r["samples_per_s"]) == pytest.approx(32 / times[0], rel=1e-9)

    # oracle: one process fed the same global batches follows the 2-rank parameters; before
    # each step, each rank's shard loss is recomputed from its outputs in numpy
    import ngdist

    x, y = (np.load(train_files / "digits.npz")[k] for k in ("x", "y"))
    tr_idx, val_idx = held_out(TRAIN_SAMPLES, 0.25)
    xt, yt = x[tr_idx], y[tr_idx]
    one = ngdist.compile(str(train_files / "mlp.onnx"), optimizer=OPTIMIZER)
    expected, shard0 = [], []
    for epoch in range(epochs):
        perm = np.random.default_rng(epoch).permutation(len(xt))  # --seed 0 + epoch
        for s in range(steps_per_epoch):
            idx = perm[s * 2 * batch:(s + 1) * 2 * batch]
            losses = [cross_entropy(one.predict({"x": xs})[0], ys).mean() for xs, ys in
                      zip(np.array_split(xt[idx], 2), np.array_split(yt[idx], 2))]
            expected.append(np.mean(losses))
            shard0.append(losses[0])
            one.step({"x": xt[idx], "y": yt[idx]})
    logged = np.array([float(r["loss"]) for r in train])
    np.testing.assert_allclose(logged, expected, rtol=1e-4, atol=1e-5)
    # the test tells the mean from rank 0's own shard loss
    assert np.max(np.abs(np.array(shard0) - expected)) > 1e-2

    # validation: the saved model (the parameters after the last step) on the held-out split
    sess = ort.InferenceSession(str(train_files / "two.onnx"), providers=["CPUExecutionProvider"])
    logits = sess.run(None, {"x": x[val_idx]})[0]
    assert float(val[-1]["accuracy"]) == float((logits.argmax(1) == y[val_idx]).mean())
    assert float(val[-1]["loss"]) == pytest.approx(cross_entropy(logits, y[val_idx]).mean(),
                                                   rel=1e-6)
    assert f"[rank 0] epoch {epochs}: loss " in proc.stdout
    assert f"val_acc {float(val[-1]['accuracy']):.4f}" in proc.stdout
    assert "val_loss=" in proc.stderr  # the progress bar's postfix

    # TensorBoard's own reader gets the CSV's values (float32 in events)
    from tensorboard.backend.event_processing import event_accumulator

    acc = event_accumulator.EventAccumulator(str(logs))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "train/samples_per_s", "train/compute_s",
                                          "train/comm_s", "train/wait_s", "train/lr",
                                          "val/loss", "val/accuracy"}
    for tag, source, column in (("train/loss", train, "loss"), ("train/lr", train, "lr"),
                                ("train/samples_per_s", train, "samples_per_s"),
                                ("train/comm_s", train, "comm_s"),
                                ("val/loss", val, "loss"), ("val/accuracy", val, "accuracy")):
        events = acc.Scalars(tag)
        assert [e.step for e in events] == [int(r["step"]) for r in source], tag
        assert [e.value for e in events] == \
            [float(np.float32(float(r[column]))) for r in source], tag

    # the PNG: a real image of the figure's size (1000 x 400), not an empty canvas
    png = (logs / "metrics.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1000, 400)
    assert len(png) > 20_000


def test_val_data_file_is_reported_per_epoch(train_files):
    _, _, x_test, y_test = load_digits()
    np.savez(train_files / "val.npz", x=x_test, y=y_test)
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "digits.npz", "--epochs", "2",
                        "--optimizer", OPTIMIZER, "--val-data", "val.npz", "--save", "one.onnx")
    assert proc.returncode == 0, proc.stderr
    sess = ort.InferenceSession(str(train_files / "one.onnx"), providers=["CPUExecutionProvider"])
    accuracy = float((sess.run(None, {"x": x_test})[0].argmax(1) == y_test).mean())
    assert "epoch 2: loss " in proc.stdout and f"val_acc {accuracy:.4f}" in proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--val-split", "0"], "--val-split 0 is not a fraction strictly between 0 and 1; e.g. "
     "--val-split 0.2 holds out a fifth of the data"),
    (["--val-split", "1"], "--val-split 1 is not a fraction strictly between 0 and 1; e.g. "
     "--val-split 0.2 holds out a fifth of the data"),
    (["--val-split", "0.2", "--val-data", "digits.npz"], "--val-split and --val-data are both "
     "given: hold out a fraction of --data with --val-split, or validate on another file with "
     "--val-data, not both"),
    (["--val-split", "0.9999"], "--val-split 0.9999 of the 640 samples of digits.npz leaves "
     "no training data; give a smaller fraction"),
    (["--val-split", "0.0001"], "--val-split 0.0001 of the 640 samples of digits.npz holds "
     "out no sample; give a larger fraction"),
    (["--log-every", "0", "--log-dir", "logs"], "--log-every 0 must be at least 1 (steps)"),
])
@pytest.mark.parametrize("n", ["1", "2"])
def test_bad_validation_and_logging_options_are_refused_before_training(train_files, flags, message,
                                                                          n):
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "digits.npz", "-n", n, *flags)
    assert proc.returncode == 1
    assert proc.stderr == f"ngdist: error: {message}\n"
    assert not (train_files / "logs" / "metrics.csv").exists()


@pytest.mark.parametrize("n", ["1", "2"])
def test_a_log_dir_holding_metrics_is_refused(train_files, n):
    (train_files / "logs").mkdir()
    (train_files / "logs" / "metrics.csv").write_text("step\n1\n")
    proc = ngdist_train(train_files, "mlp.onnx", "--data", "digits.npz", "-n", n, "--log-dir", "logs")
    assert proc.returncode == 1
    assert f"ngdist: error: {Path('logs') / 'metrics.csv'} already exists: each run writes its " \
        "own metrics; give another log directory (--log-dir, log_dir=) or remove the old " \
        "file\n" in proc.stderr
    assert (train_files / "logs" / "metrics.csv").read_text() == "step\n1\n"  # left as it was
