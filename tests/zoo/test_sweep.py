"""The model sweep as a test tier (benchmarks/model_sweep.py, benchmarks/sweep_check.py): each
model, in a subprocess of its own under a time limit, is exported by the torch frontend with
``nn.CrossEntropyLoss()``, its one-step gradients compared with torch autograd in float64 and
3 steps of SGD and of AdamW with torch's (within 1e-4, or 10x torch's own float32 error of a
tensor where float32 is ill-conditioned), and its AdamW step timed against eager torch.

* ``test_ci_model``: the subset CI runs (``CI_MODELS``: one small model of each source and of
  each Hugging Face task that passes, ~20-40 s each on one core);
* ``test_model`` (marker ``zoo``, ``pytest -m zoo tests/zoo``): every case of the catalogue,
  one model a family (``python benchmarks/model_sweep.py`` runs the same and writes the table
  in docs/benchmarks.md).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import model_sweep  # noqa: E402

CPU_LIMIT, WALL_LIMIT = 200, 270  # seconds a model; the wall limit below pytest-timeout's 300
CI_MODELS = {
    # (MobileNetV3 and 14 other torchvision/timm classifiers: tests/frontends/test_vision_zoo.py)
    "tv/squeezenet1_1": "tv/squeezenet",
    "hf/seqcls/bert": "hf/seqcls/bert",
    "hf/causal/llama": "hf/causal/llama",
    "hf/causal/afmoe": "hf/causal/afmoe",  # mixture of experts: histc, grouped_mm, top-k
    "hf/imgcls/beit": "hf/imgcls/beit",
    "hf/audiocls/audio-spectrogram-transformer": "hf/audiocls/audio-spectrogram-transformer",
}


def _check(name: str, family: str) -> None:
    row = model_sweep.run_one(name, family, CPU_LIMIT, WALL_LIMIT)
    assert row["status"] == "pass", \
        f"{name}: {row.get('stage')}: {row.get('error')} {row.get('raw_in_ngdist', '')}"
    assert row["grad_err"] <= max(1e-4, 10 * row["torch32_err"])
    assert row["ratio"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CI_MODELS))
def test_ci_model(name):
    _check(name, CI_MODELS[name])


@pytest.mark.zoo
def test_model(name, family):
    _check(name, family)


def test_the_docs_section_is_regenerated_in_place(tmp_path, monkeypatch):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other\n\ntext\n")
    monkeypatch.setattr(model_sweep, "DOC", doc)
    rows = [{"name": "tv/resnet18", "family": "tv/resnet", "status": "pass", "stage": "",
             "grad_err": 8.6e-6, "torch32_err": 0.11, "adamw_err": 2.8e-3, "ratio": 0.99},
            {"name": "hf/causal/x", "family": "hf/causal/x", "status": "fail",
             "stage": "export", "error": "GraphError: a | b"},
            {"name": "hf/causal/y", "family": "hf/causal/y", "status": "fail",
             "stage": "build", "error": "ValueError: bad config"}]
    model_sweep.write_docs(rows, "then")
    first = doc.read_text()
    model_sweep.write_docs(rows, "now")
    text = doc.read_text()
    assert text == first.replace("results of then", "results of now")
    assert text.count(model_sweep.BEGIN) == text.count(model_sweep.END) == 1
    assert "3 models, 2 built, 1 passed (**50.0%** of those built)" in text
    assert "median step ratio ngdist / eager torch over the passing models: **0.99**" in text
    assert "| hf/causal/x | x | fail | export: GraphError: a \\| b |" in text
    assert text.startswith("# Benchmarks\n\n## Other\n\ntext\n")


def test_a_raw_exception_from_inside_ngdist_is_flagged_an_ngdist_error_is_not():
    import sweep_check

    from ngdist.errors import NgdistError
    from ngdist.frontends import torch as tfront

    inside = Path(sweep_check.NGDIST) / "runtime" / "executor.py"  # a frame of ngdist's
    scope: dict = {}
    exec(compile("def run():\n    raise KeyError('x')\n", str(inside), "exec"), scope)
    with pytest.raises(KeyError) as raw:
        scope["run"]()
    row = sweep_check.describe(raw.value)
    assert row["error"] == "KeyError: 'x'"
    assert row["raw_in_ngdist"] == "ngdist/runtime/executor.py:2 (run)"
    with pytest.raises(NgdistError) as clear:  # a clear refusal, not flagged
        tfront.translate_loss(object())
    assert "raw_in_ngdist" not in sweep_check.describe(clear.value)


@pytest.mark.parametrize("name", ["hf/imgcls/bit", "hf/speech2seq/dia", "hf/causal/axk1",
                                  "hf/seq2seq/audioflamingo3"])
def test_tiny_configs_build_and_feed_what_the_model_takes(name):
    """GroupNorm groups capped (bit), a decoder of 9 code streams (dia), latent attention
    (axk1: no kv groups), an audio language model (placeholder tokens, one per audio
    embedding, not counted in the loss): each model runs on its feeds in eager torch, and the
    labels hold one row per predicted token."""
    import copy

    import torch
    from sweep_check import _tensors, loss_of

    from ngdist import zoo_sweep_hf as hf
    from ngdist.zoo_sweep_configs import AUDIO_TOKEN

    task, model_type = name.split("/")[1:]
    module, feeds, loss_fn = hf._build(task, model_type)
    with torch.no_grad():
        loss = float(loss_of(copy.deepcopy(module), loss_fn, _tensors(feeds)))
    assert np.isfinite(loss)
    if model_type == "dia":
        assert feeds["decoder_input_ids"].shape == (hf.BATCH, hf.LENGTH, 9)
        assert feeds["y"].shape == (hf.BATCH * 9 * hf.LENGTH,)
    if model_type == "audioflamingo3":
        ids, y = feeds["input_ids"], feeds["y"].reshape(hf.BATCH, -1)
        audio = int((ids == AUDIO_TOKEN).sum(1)[0])
        assert audio > 0 and (ids[:, :audio] == AUDIO_TOKEN).all()
        assert (y[:, :audio - 1] == -100).all() and (y[:, audio:] != AUDIO_TOKEN).all()


@pytest.mark.parametrize("name", [
    "hf/seq2seq/fsmt", "hf/seqcls/canine", "hf/causal/bamba", "hf/seqcls/cohere_compass_text",
    "hf/imgcls/donut-swin", "hf/imgcls/efficientnet", "hf/audiocls/wav2vec2-bert",
    "hf/speech2seq/seamless_m4t", "hf/speech2seq/kyutai_speech_to_text",
    "hf/speech2seq/moonshine_streaming", "hf/speech2seq/omniasr", "hf/speech2seq/pop2piano",
    "hf/speech2seq/qwen3_asr", "hf/imgcls/swin", "hf/causal/gptj", "hf/seqcls/deberta-v2",
    "hf/imgcls/siglip", "hf/seqcls/t5", "hf/imgcls/levit", "hf/causal/falcon_h1"])
def test_the_case_builds_and_its_float64_oracle_agrees_with_float32(name):
    """Each case runs on its feeds in float32 and in float64 (the oracle) with the same loss:
    fsmt's and canine's masks filled in their own type (float64's lowest value overflowed
    float32: an error, and NaN), a Mamba-2 mixer's heads times head size its inner width
    (bamba), a rotary table per layer type (cohere_compass_text), windows no larger than a
    stage (donut-swin), the last BatchNorm as wide as its convolution (efficientnet), stacked
    frames of the projection's width (wav2vec2-bert, seamless_m4t), text and audio code
    streams in one sequence (kyutai), a waveform audio language model (omniasr), encoder
    input embeddings (pop2piano), a whole encoder chunk of frames (qwen3_asr), Swin-like
    windows no larger than their stage, rotary dims within a head (gptj), the pooler as wide
    as the model (deberta), the vision sub-config's image size (siglip), T5's decoder start
    token (seqcls/t5), LeViT's fixed patch size, Falcon-H1's SSM width."""
    from test_sweep_cases import _agree

    from ngdist import zoo_sweep_hf as hf

    model_type = name.split("/")[2]
    module, feeds = _agree(name)
    if model_type == "kyutai_speech_to_text":  # the text token, then 4 code streams
        assert feeds["input_ids"].shape == (hf.BATCH, hf.LENGTH, 5)
        assert feeds["y"].shape == (hf.BATCH * (hf.LENGTH - 1),)
    if model_type == "omniasr":
        assert feeds["input_values"].dtype == np.float32 and feeds["input_ids"].dtype == np.int64
    if model_type == "pop2piano":
        assert feeds["input_features"].shape == (hf.BATCH, 32, module.model.config.d_model)


def test_a_model_that_needs_a_missing_package_is_not_built_and_says_which():
    import sweep_check

    from ngdist import zoo_sweep

    def make():
        raise ImportError("DinatForImageClassification requires the natten library but it "
                          "was not found in your environment.")

    row = sweep_check.check(zoo_sweep.Case("hf/imgcls/dinat", "hf/imgcls/dinat",
                                           "transformers", make))
    assert (row["status"], row["stage"], row["error"]) == \
        ("fail", "build", "not built: needs natten")
    assert model_sweep.summary([row])["built"] == 0


def test_a_gradient_off_in_one_slice_says_how_many_and_how_close_the_rest_are():
    import sweep_check

    exact = np.linspace(1.0, 2.0, 12).reshape(4, 3)
    got = exact * (1 + 3e-6)
    got[2, 1] += 0.5
    assert sweep_check._slices(got, exact) == \
        "; 1 of 4 slices along axis 0 off, the rest within 3.0e-06"
    assert sweep_check._slices(got[:, 1], exact[:, 1]) == \
        "; 1 of 4 slices along axis 0 off, the rest within 3.0e-06"  # a bias: its entries
    assert sweep_check._slices(got[0, :1], exact[0, :1]) == ""


def test_a_kink_upstream_of_the_worst_tensor_is_named_with_its_one_slice():
    """A kink shows in the one channel next to it, past 10x torch's float32 error there and
    possibly within the bound (a trained state's bias); the tensors before it inherit it in
    many slices, and the worst of those is the one the message starts with."""
    import sweep_check

    exact = {n: np.linspace(1.0, 2.0, 12).reshape(4, 3) for n in ("past", "near", "fine")}
    got = {n: e * (1 + 3e-6) for n, e in exact.items()}
    got["near"][2] += 1e-4  # 5e-5 of the largest entry: within the 1e-4 bound
    got["past"][1:] += 0.5
    errors = {n: sweep_check.max_off(got[n], exact[n]) / 2.0 for n in exact}
    default = dict.fromkeys(exact, 3e-6)  # torch's own float32 error of each

    def pair(name):
        return got[name], exact[name], 0.0

    assert sweep_check._kink_sign("past", errors, default, pair) == \
        "; 3 of 4 slices along axis 0 off, the rest within 1.8e-06; 1 of 4 slices of near " \
        "along axis 0 past 10x torch's float32 error (3.0e-06), the rest within 3.0e-06"
    got["past"][1:] -= 0.5
    got["past"][1] += 0.5
    errors["past"] = 0.25
    assert sweep_check._kink_sign("past", errors, default, pair) == \
        "; 1 of 4 slices along axis 0 off, the rest within 3.0e-06"
    got["past"][1:] += 0.5
    got["near"][0] += 1e-4  # two channels: not the sign of one kink
    assert sweep_check._kink_sign("past", errors, default, pair) == \
        "; 3 of 4 slices along axis 0 off, the rest within 1.8e-06"
    default["near"] = 1e-5  # within 10x torch's own error: no sign there
    got["near"][0] -= 1e-4
    assert sweep_check._kink_sign("past", errors, default, pair) == \
        "; 3 of 4 slices along axis 0 off, the rest within 1.8e-06"


@pytest.mark.parametrize("failing", ["gradients", "adamw"])
def test_one_slice_off_is_checked_again_on_a_second_batch_more_is_a_failure(monkeypatch,
                                                                              failing):
    """A stage off in one slice of its worst tensor (a kink within float32's error) has every
    stage run again on a second batch of float inputs; more slices, or no float input to
    draw another batch of, is the failure."""
    import sweep_check

    seen = []

    def fake(module, feeds, loss_fn, out, opt="gradients"):
        out["stage"] = opt
        if opt == "gradients":
            seen.append(feeds)
        if opt == failing and len(seen) == 1:
            raise sweep_check.StageError(message)
        return f"{opt} trainer"

    monkeypatch.setattr(sweep_check, "check_gradients", fake)
    monkeypatch.setattr(sweep_check, "check_training",
                        lambda module, feeds, loss_fn, opt, out: fake(module, feeds, loss_fn,
                                                                      out, opt))
    feeds = {"x": np.zeros((2, 3), np.float32), "y": np.array([1, 0])}
    message = "w 2e-01 from float64 (torch float32: 1e-05); 1 of 8 slices along axis 0 off, " \
              "the rest within 1.0e-06"
    out: dict = {}
    trainer, second = sweep_check.stages_or_second_batch(None, feeds, None, out)
    assert out["first_batch"] == f"{failing}: {message}" and second is seen[1]
    assert trainer == "adamw trainer"
    assert second["x"].dtype == np.float32 and second["x"].any()
    assert second["y"] is feeds["y"]
    seen.clear()
    message = message.replace("; 1 of 8", "; 2 of 8")
    with pytest.raises(sweep_check.StageError):
        sweep_check.stages_or_second_batch(None, feeds, None, {})
    seen.clear()
    message = message.replace("; 2 of 8", "; 1 of 8")
    with pytest.raises(sweep_check.StageError):  # token ids only: no second batch to draw
        sweep_check.stages_or_second_batch(None, {"ids": feeds["y"]}, None, {})


def test_a_model_past_its_memory_or_wall_time_is_a_failed_row(monkeypatch):
    monkeypatch.setattr(model_sweep, "MEMORY", 1 << 20)  # the interpreter alone holds more
    row = model_sweep.run_one("tv/resnet18", "tv/resnet", 60, 60)
    assert (row["status"], row["stage"], row["error"]) == \
        ("fail", "memory", "more than 1 MiB resident")
    monkeypatch.setattr(model_sweep, "MEMORY", 8 << 30)
    started, popen = [], model_sweep.subprocess.Popen
    monkeypatch.setattr(model_sweep.subprocess, "Popen",
                        lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    row = model_sweep.run_one("tv/resnet18", "tv/resnet", 60, 1)
    assert (row["stage"], row["error"]) == ("timeout", "no result within 1 s of wall time")
    assert "memory_cap" not in row and "cpu_limit" not in row
    row = model_sweep.run_one("tv/resnet18", "tv/resnet", 900, 1, memory=12 << 30)
    assert (row["memory_cap"], row["cpu_limit"]) == ("12 GiB", "900 s")  # above the defaults
    assert "(run under a resident cap of 12 GiB) (run under a CPU limit of 900 s)" in \
        model_sweep.table([row])
    with pytest.raises(ProcessLookupError):  # its session (a forked oracle too) is gone
        os.killpg(started[0].pid, 0)


def test_a_model_killed_below_its_cpu_limit_is_not_called_too_slow(monkeypatch):
    """A model's process ended by SIGKILL (the machine's out-of-memory killer) is a "killed"
    row that gives the CPU time it had used; one past its CPU limit is a timeout."""
    import signal
    import threading

    row = model_sweep.run_one("tv/resnet18", "tv/resnet", 2, 60)
    assert (row["stage"], row["error"]) == ("timeout", "more than 2 s of CPU")
    started, popen = [], model_sweep.subprocess.Popen

    def start(*a, **k):
        started.append(popen(*a, **k))
        threading.Timer(3.0, os.kill, (started[-1].pid, signal.SIGKILL)).start()
        return started[-1]

    monkeypatch.setattr(model_sweep.subprocess, "Popen", start)
    row = model_sweep.run_one("tv/resnet18", "tv/resnet", 60, 60)
    assert row["stage"] == "killed", row
    assert row["error"].startswith("killed (SIGKILL) after ") and row["error"].endswith(
        " s of CPU, below its limit: the machine's out-of-memory killer or another process "
        "ended it")
    assert 0 < float(row["error"].split()[3]) < 60


def test_only_takes_a_case_name_alone_and_a_prefix_ending_in_a_slash(capsys):
    model_sweep.main(["--source", "transformers", "--list", "--only", "hf/causal/llama",
                      "hf/audiocls/"])
    names = [line.split("\t")[0] for line in capsys.readouterr().out.splitlines()]
    assert "hf/causal/llama" in names and "hf/causal/llama4" not in names
    assert all(n == "hf/causal/llama" or n.startswith("hf/audiocls/") for n in names)
    assert len([n for n in names if n.startswith("hf/audiocls/")]) > 5


def test_only_runs_a_model_beyond_the_catalogue_as_its_own_family(capsys):
    model_sweep.main(["--source", "torchvision", "--list", "--only", "tv/resnet18",
                      "timm/resnet50d", "tv/", "hf/causal/nonesuch"])
    listed = [line.split("\t") for line in capsys.readouterr().out.splitlines()]
    assert ["timm/resnet50d", "timm/resnet50d"] in listed  # (name, family)
    assert [n for n, _ in listed].count("tv/resnet18") == 1
    assert "hf/causal/nonesuch" not in [n for n, _ in listed]  # a Hugging Face case: catalogue only


def test_a_nan_error_is_out_of_bounds_and_its_tensor_named():
    """The sweep's judge: an error that is NaN (a NaN gradient of ngdist, or against torch's
    float32) fails the tensor, never passes as 'not above the bound'."""
    import sweep_check

    nan = float("nan")
    assert sweep_check._judge({"a": 1e-6, "b": 1e-6}, {"a": 1e-7, "b": 1e-7},
                              {"a": 1e-6, "b": 1e-6})[2] is None
    worst, _, bad = sweep_check._judge({"a": 1e-6, "b": nan}, {"a": 1e-7, "b": 1e-7},
                                       {"a": 1e-6, "b": nan})
    assert bad == "b" and np.isnan(worst)
    assert sweep_check._judge({"a": 2e-3}, {"a": 1e-3}, {"a": nan})[2] is None  # 2x own: in


def test_a_batchnorm_normalizing_a_few_values_is_counted_and_the_timm_case_gets_larger_images():
    """At 32x32 a network that downsamples 32 times ends on 1x1 maps, where each BatchNorm
    channel normalizes the batch's 4 values and float32 is noise: the case takes the next
    side at which every BatchNorm normalizes at least ``BN_VALUES`` values."""
    import torch

    from ngdist import zoo_sweep

    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3, stride=2, padding=1),
                              torch.nn.BatchNorm2d(4), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 16 * 16, 8), torch.nn.BatchNorm1d(8))
    images = np.zeros((4, 3, 32, 32), np.float32)
    assert zoo_sweep._fewest_bn_values(net, images) == 4 * 16 * 16  # BatchNorm1d of [N, C]: none
    assert not net.training and all(not m._forward_pre_hooks for m in net.modules())
    _, feeds, _ = zoo_sweep._timm_build("resnet10t")  # 1x1 maps at 32, 2x2 at 64
    assert feeds["x"].shape == (zoo_sweep.BATCH, 3, 64, 64)


@pytest.mark.parametrize("ctor, side", [("densenet121", 64), ("resnet18", 64), ("vgg11_bn", 32),
                                        ("inception_v3", 160), ("convnext_tiny", 32)])
def test_a_torchvision_case_takes_the_side_at_which_its_batchnorms_normalize_enough(ctor,
                                                                                     side):
    """torchvision's constructors follow timm's rule (DenseNet-169's last BatchNorms over 4
    values: torch's own float32 gradients 45% off float64, its AdamW steps chaos); a model
    without BatchNorm keeps the side it was given."""
    from ngdist import zoo_sweep

    model, feeds, _ = zoo_sweep._tv_build(ctor)
    assert feeds["x"].shape[-1] == side
    assert zoo_sweep._fewest_bn_values(model, feeds["x"]) >= zoo_sweep.BN_VALUES


def test_leds_float64_oracle_has_finite_gradients_that_agree_with_float32():
    """LED's windowed attention in float64 masks with float32's lowest value and keeps its
    softmax in float64 (zoo_sweep_float64._led_float64): float64's lowest value, summed twice and
    cast to float32 by the model's softmax, made a padding query's window all -inf, and 24
    parameters' float64 gradients NaN."""
    from step_probe import gradient_errors
    from sweep_check import torch_grads

    from ngdist import zoo_sweep_hf as hf

    module, feeds, loss_fn = hf._build("seq2seq", "led")
    assert (feeds["attention_mask"] == 0).any()  # padding tokens in the batch
    _, g64 = torch_grads(module, feeds, loss_fn, True)
    _, g32 = torch_grads(module, feeds, loss_fn, False)
    assert all(np.isfinite(g).all() for g in g64.values())
    errors = gradient_errors({f"{n}.grad": g for n, g in g32.items()}, g64)
    assert max(errors.values()) < 1e-5, max(errors, key=errors.get)


def test_the_trained_state_is_kept_in_its_own_type_as_a_copy():
    """The sweep keeps the state before and after each step of ngdist and of torch float32
    in float32 (exact; the float64 oracle's in float64), copied: half the bytes of float64
    copies, which with the oracle's own took beit_base past the sweep's 8 GiB."""
    import torch
    from sweep_check import _state

    module = torch.nn.Linear(3, 2)
    state = _state(module)
    assert {k: v.dtype for k, v in state.items()} == {"weight": np.float32, "bias": np.float32}
    before = state["weight"].copy()
    with torch.no_grad():
        module.weight.add_(1.0)
    np.testing.assert_array_equal(state["weight"], before)
    assert _state(module.double())["weight"].dtype == np.float64


def test_timm_vgg_is_built_with_a_narrow_pre_logits_layer():
    """VGG's 7x7 pre-logits convolution to 4096 channels (103 M parameters) gets 64 hidden
    channels: the architecture at 11 M parameters, under the sweep's memory cap."""
    from ngdist import zoo_sweep

    module, _, _ = zoo_sweep._timm_build("vgg11")
    assert module.pre_logits.fc1.out_channels == 64
    assert sum(p.numel() for p in module.parameters()) < 12_000_000


def test_the_oracle_runs_in_a_child_process_and_sends_its_arrays_back():
    import os

    from sweep_check import forked

    out = forked(lambda: {"pid": os.getpid(), "empty": {},
                          "g": {"a": np.arange(3.0), "b": np.ones((2, 2), np.float32)}})
    assert out["pid"] != os.getpid() and out["empty"] == {}
    np.testing.assert_array_equal(out["g"]["a"], np.arange(3.0))
    assert out["g"]["b"].dtype == np.float32 and out["g"]["b"].shape == (2, 2)

    def fails() -> dict:
        raise ValueError("no oracle")

    with pytest.raises(RuntimeError, match="^in the torch oracle: ValueError: no oracle$"):
        forked(fails)


def test_the_oracles_later_asks_see_the_state_it_was_forked_with():
    """The float32 runs beyond the default one are asked of the same child after the parent
    has stepped its model: they start from the state before the step, and what the first
    ask kept (the float64 reference) is reused, not recomputed."""
    import os

    from sweep_oracle import Oracle

    state, calls = {"w": np.zeros(2)}, []

    def oracle(runs: tuple[str, ...]) -> dict:
        calls.append(runs)
        return {"pid": os.getpid(), "calls": len(calls), "w": {"w": state["w"].copy()}}

    with Oracle(oracle) as child:
        first = child.ask(("default",))
        state["w"] += 1.0  # the parent's step
        later = child.ask(("no_mkldnn", "input_ulp"))
    assert first["pid"] == later["pid"] != os.getpid()
    assert (first["calls"], later["calls"]) == (1, 2) and calls == []
    np.testing.assert_array_equal(later["w"]["w"], np.zeros(2))


def test_a_tensor_in_bounds_against_the_default_run_asks_no_other_run():
    from sweep_check import judge_over_runs

    class Asked:
        def __init__(self) -> None:
            self.asked: list[tuple[str, ...]] = []

        def ask(self, runs: tuple[str, ...]) -> dict:
            self.asked.append(runs)
            return {"runs": {r: {"w": 1e-3} for r in runs}}

    every = ("default", "no_mkldnn", "two_threads")
    oracle, runs = Asked(), {"default": {"w": 1e-6}}
    assert judge_over_runs({"w": 5e-5}, {"w": 1.0}, runs, oracle, every)[2] is None
    assert oracle.asked == [] and list(runs) == ["default"]
    assert judge_over_runs({"w": 5e-3}, {"w": 1.0}, runs, oracle, every)[2] is None
    assert oracle.asked == [("no_mkldnn", "two_threads")] and list(runs) == list(every)
    runs = {"default": {"w": 1e-6}}
    assert judge_over_runs({"w": 5e-2}, {"w": 1.0}, runs, Asked(), every)[2] == "w"


def test_a_timm_heads_functional_dropout_is_off_and_the_forward_deterministic():
    """timm's GhostNet applies ``F.dropout(x, p=self.drop_rate)`` (0.2 by default) in its
    head, held by no Dropout module: the case sets every module's float ``drop_rate`` to 0,
    so that torch's and ngdist's forwards see the same function (with different masks their
    losses were 1.70 and 1.67)."""
    import torch

    from ngdist import zoo_sweep

    module, feeds, _ = zoo_sweep._timm_build("ghostnet_050")
    assert module.training and module.drop_rate == 0.0
    x = torch.from_numpy(feeds["x"])
    outs = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            outs.append(module(x).numpy().tobytes())
    assert outs[0] == outs[1]


def _conv_net(side: int = 12):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8),
                               torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3), torch.nn.Flatten(),
                               torch.nn.Linear(8 * (side - 4) ** 2, 5))


def test_each_torch_float32_run_is_a_float32_run_of_the_same_function_by_another_path():
    """torch's own float32 error is taken over several equally valid float32 runs: each is
    near float64 (the same function), and the conv model's runs are not all the same bits
    (another summation order each: one sample of float32's error is one of several)."""
    import torch
    from step_probe import gradient_errors
    from sweep_oracle import TORCH32_RUNS, float32_runs, torch_grads

    module = _conv_net()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 3, 12, 12)).astype(np.float32),
             "y": rng.integers(0, 5, 4)}
    loss_fn = torch.nn.CrossEntropyLoss()
    assert float32_runs(module, feeds) == TORCH32_RUNS
    tokens = {"ids": np.arange(6).reshape(2, 3), "mask": np.ones((2, 3), np.float32)}
    assert float32_runs(torch.nn.Linear(3, 2), tokens) == ("default", "no_mkldnn",
                                                            "two_threads")
    threads = torch.get_num_threads()
    _, g64 = torch_grads(module, feeds, loss_fn, True)
    seen = set()
    for run in TORCH32_RUNS:
        _, g32 = torch_grads(module, feeds, loss_fn, False, run)
        assert torch.get_num_threads() == threads and torch.backends.mkldnn.enabled
        errors = gradient_errors({f"{n}.grad": g for n, g in g32.items()}, g64)
        assert max(errors.values()) < 1e-5, (run, errors)
        seen.add(b"".join(g32[n].tobytes() for n in sorted(g32)))
    assert len(seen) >= 3, "the float32 runs of a conv net all gave the same bits"
    with pytest.raises(ValueError, match="^unknown torch float32 run 'fp16'; one of "):
        torch_grads(module, feeds, loss_fn, False, "fp16")


def test_the_runs_set_torchs_settings_inside_and_move_a_float_input_by_one_ulp():
    import torch
    from sweep_oracle import float32_run

    module = _conv_net(side=5)
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 5, 5)).astype(np.float32),
             "mask": np.ones((2, 5), np.float32), "y": np.array([1, 2])}
    with float32_run("no_mkldnn", module, feeds):
        assert not torch.backends.mkldnn.enabled
    with float32_run("two_threads", module, feeds):
        assert torch.get_num_threads() == 2
    with float32_run("channels_last", module, feeds) as (net, tensors):
        assert net[0].weight.is_contiguous(memory_format=torch.channels_last)
        assert tensors[0].is_contiguous(memory_format=torch.channels_last)
    with float32_run("input_ulp", module, feeds) as (_, (x, mask, y)):
        steps = np.abs(x.numpy().view(np.int32) - feeds["x"].view(np.int32))
        assert (steps == 1).all()  # every entry one float32 ulp away (none crosses 0 here)
        assert (x.numpy() > feeds["x"]).any() and (x.numpy() < feeds["x"]).any()
        assert mask.numpy().tobytes() == feeds["mask"].tobytes()
        assert y.tolist() == [1, 2]


def test_torchs_own_float32_error_is_the_largest_of_its_runs_and_only_widens_the_bound():
    """A tensor 20x torch's default run's error fails against that run alone; it passes when
    another valid torch float32 run is 3x off too, and fails again past 10x the largest."""
    import sweep_check

    runs = {"default": {"a": 1e-5, "b": 1e-7}, "no_mkldnn": {"a": 3e-5, "b": 1e-7}}
    own = sweep_check.largest_of_runs(runs)
    assert own == {"a": 3e-5, "b": 1e-7}
    far = {"a": 1.0, "b": 1.0}  # ngdist far from torch's default float32 result
    assert sweep_check._judge({"a": 2e-4, "b": 1e-6}, runs["default"], far)[2] == "a"
    assert sweep_check._judge({"a": 2e-4, "b": 1e-6}, own, far)[2] is None
    assert sweep_check._judge({"a": 4e-4, "b": 1e-6}, own, far)[2] == "a"
    spread = sweep_check.spread({"a": 2e-4, "b": 1e-6}, runs, step=2)
    assert spread == {"tensor": "a", "step": 2, "ngdist": 2e-4, "default": 1e-5,
                      "no_mkldnn": 3e-5, "default_ratio": 2.0, "ratio": pytest.approx(2 / 3)}


def test_a_trained_state_off_in_one_slice_says_so_relative_to_the_states_scale():
    import sweep_check
    import sweep_steps

    before = {"w": np.ones((4, 3)), "b": np.zeros(4)}
    exact = {"w": before["w"] - 0.01, "b": before["b"] + 0.5}
    scales = sweep_steps.scales(exact, before)
    assert scales == {"w": 0.99, "b": 0.5}  # the largest entry, or the largest update
    got = exact["w"].copy()
    got[1, 2] += 1e-3
    assert sweep_check._slices(got, exact["w"], scales["w"]) == \
        "; 1 of 4 slices along axis 0 off, the rest within 0.0e+00"


def test_an_infinite_entry_a_step_leaves_as_it_was_is_no_error_and_one_it_changes_is():
    """timm's Gemma 4 ViT clips activations to parameters that start at -inf/+inf: equal
    infinities are no error (they were NaN, failing every row), and an infinity where float64
    has a finite value is an infinite one."""
    from sweep_steps import scales, state_errors

    before = {"lo": np.array([-np.inf, -np.inf]), "w": np.array([1.0, 2.0])}
    exact = {"lo": before["lo"].copy(), "w": np.array([0.9, 2.0])}
    assert scales(exact, before) == {"lo": pytest.approx(0.1), "w": 2.0}
    same = {"lo": before["lo"].copy(), "w": np.array([0.9, 2.0 + 2e-6])}
    assert state_errors(same, exact, before, {}) == {"lo": 0.0, "w": pytest.approx(1e-6)}
    moved = {"lo": np.array([-np.inf, 0.0]), "w": exact["w"]}
    assert state_errors(moved, exact, before, {})["lo"] == np.inf


def test_adamws_unchecked_entries_are_those_whose_sign_the_gradient_bound_leaves_open():
    """An entry whose float64 gradient is within the gradients stage's bound of zero (10x
    torch's float32 error of the tensor, or 1e-4 of its largest entry) can have the other
    sign in a gradient that passed; AdamW's normalised step then moves the other way. Those
    entries are left out of the comparison (3x the error left entries out at 3-10x it:
    timm's NextViT failed at step 1 by one such flip); larger ones are compared."""
    from sweep_steps import noise_entries

    g64 = {"w": np.array([1.0, 0.05, 0.02, 5e-5, -0.2]), "b": np.array([4.0, 0.0])}
    g32 = {"w": g64["w"] + np.array([0.0, 0.0, 0.004, 0.0, 0.0]), "b": g64["b"].copy()}
    noise = noise_entries(g64, g32)
    assert noise["w"].tolist() == [False, False, True, True, False]  # bound 0.04; 1e-4
    assert noise["b"].tolist() == [False, True]


def test_adamws_noise_entries_widen_to_the_largest_float32_error_over_torchs_runs():
    """The gradients stage's bound of a tensor is 10x the largest float32 error over torch's
    runs, so AdamW's noise entries, asked over every run, are those of each run together
    (DenseNet-169's last BatchNorm biases: torch's default run 2e-2 off float64 at step 3,
    another run and ngdist's 45% off, every entry's sign open)."""
    import torch
    from sweep_oracle import TORCH32_RUNS, float32_runs, state_of, torch_grads
    from sweep_steps import WIDER, noise_entries, step_oracle

    module = _conv_net()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 3, 12, 12)).astype(np.float32),
             "y": rng.integers(0, 5, 4)}
    loss_fn = torch.nn.CrossEntropyLoss()

    def make_opt(ps):
        return torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1)

    optimizer = make_opt(module.parameters())
    runs = float32_runs(module, feeds)
    assert runs == TORCH32_RUNS
    oracle = step_oracle(module, optimizer, feeds, loss_fn, make_opt, "adamw", state_of(module))
    first = oracle(("default",))["noise"]
    wide = oracle((WIDER, *runs))
    g64 = torch_grads(module, feeds, loss_fn, True)[1]
    each = [noise_entries(g64, torch_grads(module, feeds, loss_fn, False, r)[1]) for r in runs]
    for k, mask in wide["noise"].items():
        assert np.array_equal(mask, np.logical_or.reduce([e[k] for e in each])), k
        assert np.all(mask >= first[k])
    assert set(wide["runs"]) == set(runs) and "ref32" in wide


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_torch_steps_from_one_state_leave_the_optimizers_state_as_it_was(opt):
    """Every float32 run steps from the same state: a step must not update the optimizer's
    momentum or moments in place (torch's load_state_dict keeps a float32 tensor as it is),
    or the next run starts from another state (SGD step 3 of dpn68 measured 6e-8 from float64
    for the first run and 2e-3 to 7e-3 for the runs after it)."""
    import torch
    from sweep_oracle import TORCH32_RUNS, torch_step

    module = _conv_net()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 3, 12, 12)).astype(np.float32),
             "y": rng.integers(0, 5, 4)}
    loss_fn = torch.nn.CrossEntropyLoss()
    make_opt = {"sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
                "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1)}[opt]
    optimizer = make_opt(module.parameters())
    for _ in range(2):  # a state with momentum / moments and a step count
        optimizer.zero_grad()
        loss_fn(module(torch.from_numpy(feeds["x"])), torch.from_numpy(feeds["y"])).backward()
        optimizer.step()
    saved = {k: [v.clone() if torch.is_tensor(v) else v for v in s.values()]
             for k, s in optimizer.state_dict()["state"].items()}
    first = torch_step(module, optimizer, feeds, loss_fn, make_opt, False)
    for run in TORCH32_RUNS:
        torch_step(module, optimizer, feeds, loss_fn, make_opt, False, run)
    again = torch_step(module, optimizer, feeds, loss_fn, make_opt, False)
    assert all(first[k].tobytes() == again[k].tobytes() for k in first)
    for k, s in optimizer.state_dict()["state"].items():
        for before, now in zip(saved[k], s.values()):
            assert torch.equal(torch.as_tensor(before), torch.as_tensor(now))


def test_a_parameter_torch_reads_without_gradient_but_ngdist_trains_fails_the_gradients(
        monkeypatch: pytest.MonkeyPatch):
    """A parameter read only under torch.no_grad (LayoutLMv3's relative position tables,
    VibeVoice's audio tokenizer) has no torch gradient. Were ngdist to give it one (as it
    does with its stop-gradient marks ignored and nothing frozen, below), the row would fail
    later at an optimizer step without saying why: the gradient stage names it."""
    import sweep_check
    import torch

    from ngdist.frontends import torch as tfront
    from ngdist.passes.autodiff import driver

    class Biased(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.table = torch.nn.Linear(4, 3), torch.nn.Parameter(torch.randn(3))

        def forward(self, x):
            with torch.no_grad():
                shift = self.table * 2.0
            return self.lin(x) + shift

    feeds = {"x": np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32),
             "y": np.array([0, 1, 2, 0, 1])}
    torch.manual_seed(0)
    sweep_check.check_gradients(Biased().train(), feeds, torch.nn.CrossEntropyLoss(), {})
    monkeypatch.setattr(driver, "STOP_GRADIENT", "ngdist.test.no_such_mark")
    monkeypatch.setattr(tfront, "gradient_free", lambda graph: set())
    torch.manual_seed(0)
    with pytest.raises(sweep_check.StageError, match=r"1 parameters that torch gives no "
                       r"gradient .* get one from ngdist, e.g. \['table'\]"):
        sweep_check.check_gradients(Biased().train(), feeds, torch.nn.CrossEntropyLoss(), {})


def test_grad_walk_names_the_first_tensor_past_torchs_error_and_its_slices(monkeypatch):
    """benchmarks/grad_walk.py on a two-layer model: ngdist's gradients agree with float64
    within torch float32's error; one channel of the first layer's gradient moved is the
    first tensor past 10x torch's error from the loss back, in 1 slice."""
    import grad_walk
    import step_probe
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32),
             "y": np.array([0, 1, 2, 1])}
    rows = grad_walk.walk(module, feeds, torch.nn.CrossEntropyLoss())
    assert [r["tensor"] for r in rows] == ["2.bias", "2.weight", "0.bias", "0.weight"]
    assert all(r["past"] == 0 and r["ngdist"] < 1e-6 for r in rows)
    run_step = step_probe.run_step

    def one_channel_off(model, batch):
        got = run_step(model, batch)
        got["0.weight.grad"][3] += 0.1
        return got

    monkeypatch.setattr(step_probe, "run_step", one_channel_off)
    rows = grad_walk.walk(module, feeds, torch.nn.CrossEntropyLoss())
    assert [(r["tensor"], r["past"], r["slices"]) for r in rows if r["past"]] == \
        [("0.weight", 1, 5)]
