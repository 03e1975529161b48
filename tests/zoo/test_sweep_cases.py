"""The model sweep's tiny Hugging Face configs (ngdist.zoo_sweep_configs and zoo_sweep_fixups) of
architectures whose default config derives sizes the shrinking changed: each case builds, runs
on its feeds in eager torch and gives a finite loss (before its fix-up each raised while the
model was built or run).
"""
from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def _loss(name: str) -> tuple[float, dict[str, np.ndarray]]:
    import torch
    from sweep_check import _tensors, loss_of

    from ngdist import zoo_sweep_hf as hf

    task, model_type = name.split("/")[1:]
    module, feeds, loss_fn = hf._build(task, model_type)
    with torch.no_grad():
        return float(loss_of(copy.deepcopy(module), loss_fn, _tensors(feeds))), feeds


@pytest.mark.parametrize("model_type", ["gemma4_assistant", "gemma4_unified_assistant"])
def test_a_drafter_that_reads_its_target_models_states_is_not_built_and_says_why(model_type):
    from ngdist import zoo_sweep_hf as hf

    with pytest.raises(ValueError, match=f"^not built: {model_type} is a speculative-decoding "
                                         r"drafter \(its forward reads the target model's "
                                         r"inputs_embeds and shared_kv_states\)$"):
        hf._build("causal", model_type)


@pytest.mark.parametrize("name", ["hf/imgcls/hgnet_v2", "hf/causal/blt",
                                  "hf/imgcls/mobilevitv2", "hf/seqcls/esmc"])
def test_a_config_whose_sizes_derive_from_others_builds_tiny_and_runs(name):
    """HGNetV2's head reads ``hidden_sizes[-1]``, its stages ``stage_*_channels`` (the head
    did not fit the last stage); BLT derives its global model's input projection from the
    local encoder's width (an RMSNorm of 64 met 32 features); MobileViTV2 unfolds its
    last 2x2 maps into patches of ``patch_size`` (8 left no patch); ESM C normalises its keys
    over the hidden width (no kv groups)."""
    loss, _ = _loss(name)
    assert np.isfinite(loss)


def test_an_audio_lm_without_a_placeholder_id_gets_one_inside_the_vocabulary():
    """Voxtral's config sets no ``audio_token_id`` (None: no placeholder matched, and its
    forward raised): the tiny config's is the sweep's placeholder, one per audio embedding."""
    from ngdist import zoo_sweep_hf as hf
    from ngdist.zoo_sweep_configs import AUDIO_TOKEN
    from ngdist.zoo_sweep_fixups import tiny_config

    assert tiny_config("voxtral").audio_token_id == AUDIO_TOKEN
    loss, feeds = _loss("hf/speech2seq/voxtral")
    assert np.isfinite(loss)
    assert (feeds["input_ids"] == AUDIO_TOKEN).sum() > 0


def test_prophetnets_float64_oracle_has_finite_gradients_that_agree_with_float32():
    """ProphetNet fills its stream masks with float64's lowest value, which overflowed its
    float32 tensors: torch's float64 gradients were NaN (no oracle). Its module sees float32's
    lowest value in float64 too: finite float64 gradients, the loss float32's."""
    import torch
    from sweep_check import _tensors, loss_of, to_float64

    from ngdist import zoo_sweep_hf as hf

    module, feeds, loss_fn = hf._build("seq2seq", "prophetnet")
    loss32 = float(loss_of(copy.deepcopy(module), loss_fn, _tensors(feeds)))
    model64 = to_float64(copy.deepcopy(module))
    loss64 = loss_of(model64, loss_fn, _tensors(feeds, True))
    loss64.backward()
    grads = [p.grad for p in model64.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert abs(loss32 - float(loss64)) <= 1e-5 * max(1.0, abs(float(loss64)))


def test_a_classifier_returning_its_scores_as_last_hidden_state_is_fed_to_the_loss():
    """PP-LCNet's image classifier returns its class scores as ``last_hidden_state`` (no
    ``logits``): the case's module returns them, one row of 3 scores a sample."""
    import torch

    from ngdist import zoo_sweep_hf as hf

    module, feeds, _ = hf._build("imgcls", "pp_lcnet")
    with torch.no_grad():
        scores = module(torch.from_numpy(feeds["pixel_values"]))
    assert tuple(scores.shape) == (hf.BATCH, hf.LABELS)


def test_an_audio_lm_that_runs_its_tower_itself_gets_placeholders_and_a_frame_mask():
    """Qwen2-Audio has no get_audio_features (its forward runs the audio tower on features
    and a frame mask): it was fed as an encoder-decoder, its decoder_input_ids ignored and no
    audio in the graph. Now one placeholder per audio embedding leads each sequence, not
    counted in the loss, and the features come with their frame mask."""
    from ngdist import zoo_sweep_hf as hf
    from ngdist.zoo_sweep_configs import AUDIO_TOKEN

    loss, feeds = _loss("hf/seq2seq/qwen2_audio")
    assert np.isfinite(loss) and "decoder_input_ids" not in feeds
    assert feeds["feature_attention_mask"].shape == (hf.BATCH, feeds["input_features"].shape[2])
    ids, y = feeds["input_ids"], feeds["y"].reshape(hf.BATCH, -1)
    audio = int((ids == AUDIO_TOKEN).sum(1)[0])
    assert audio > 0 and (ids[:, :audio] == AUDIO_TOKEN).all()
    assert (y[:, :audio - 1] == -100).all()


@pytest.mark.parametrize("model_type", ["musicgen", "musicgen_melody"])
def test_a_causal_lm_over_parallel_code_streams_predicts_each_streams_next_code(model_type):
    """MusicGen's causal LM takes (batch * codebooks, time) codes and returns logits of
    (batch * codebooks, time, vocabulary): each label is the next code of its own stream, and
    the loss is torch's cross-entropy over all of them."""
    import torch

    from ngdist import zoo_sweep_hf as hf

    loss, feeds = _loss(f"hf/causal/{model_type}")
    ids, y = feeds["input_ids"], feeds["y"]
    k = ids.shape[0] // hf.BATCH
    assert k > 1 and y.shape == (ids.size,)
    nxt = y.reshape(hf.BATCH, k, -1)
    np.testing.assert_array_equal(nxt[..., :-1], ids.reshape(hf.BATCH, k, -1)[..., 1:])
    module, _, _ = hf._build("causal", model_type)
    with torch.no_grad():
        logits = module.model(input_ids=torch.from_numpy(ids)).logits
    assert tuple(logits.shape[:2]) == ids.shape
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             torch.from_numpy(y))
    assert loss == pytest.approx(float(want), rel=1e-6)


@pytest.mark.parametrize("name", ["hf/seqcls/xmod", "hf/causal/xmod"])
def test_xmod_runs_with_its_first_language_adapter(name):
    """X-MOD refuses a forward until a language (its adapters) is chosen."""
    loss, _ = _loss(name)
    assert np.isfinite(loss)


def test_reformers_tiny_config_trains_as_a_decoder_on_a_short_batch():
    """Reformer's default axial position table needs 4096 positions a training batch."""
    loss, _ = _loss("hf/causal/reformer")
    seq, _ = _loss("hf/seqcls/reformer")
    assert np.isfinite(loss) and np.isfinite(seq)


@pytest.mark.parametrize("model_type", ["xlm", "flaubert"])
def test_xlms_width_under_its_own_name_is_shrunk(model_type):
    """XLM and Flaubert keep their hidden size as ``emb_dim`` (2048 by default: 100 M
    parameters in 2 layers, Flaubert's case held 5.9 GiB resident): the tiny config's is the
    sweep's width."""
    from ngdist.zoo_sweep_configs import WIDTH
    from ngdist.zoo_sweep_fixups import tiny_config

    assert tiny_config(model_type).emb_dim == WIDTH


@pytest.mark.parametrize("model_type,limit", [
    ("luke", 100_000), ("gemma4_text", 100_000), ("roc_bert", 100_000), ("zamba", 1_000_000),
    ("longcat_flash", 100_000), ("timm_wrapper", 1_000_000), ("nemo_speechlm", 1_000_000)])
def test_a_tiny_config_builds_a_tiny_model(model_type, limit):
    """Sizes under names of the model's own (LUKE's entity table, Gemma 4's per-layer
    embeddings, RoCBert's pronunciation and glyph tables, Zamba's derived attention width,
    LongCat-Flash's expert widths, the timm wrapper's resnet50, Nemotron transcribe's
    52-layer text model) held 13-134 M parameters:
    each tiny config builds a model under ``limit`` parameters (on the meta device)."""
    import torch
    from transformers.models.auto import modeling_auto

    from ngdist import zoo_sweep_hf as hf

    task = "seqcls" if model_type == "luke" else \
        "imgcls" if model_type == "timm_wrapper" else \
        "seq2seq" if model_type == "nemo_speechlm" else "causal"
    if model_type == "timm_wrapper":
        from ngdist.zoo_vision import import_timm
        import_timm()
    name = getattr(modeling_auto, hf.TASKS[task])[model_type]
    with torch.device("meta"):
        model = getattr(hf._transformers(), name)(hf.tiny_config(model_type))
    assert sum(p.numel() for p in model.parameters()) < limit


@pytest.mark.parametrize("model_type", ["zamba", "zamba2"])
def test_zambas_layers_are_a_mamba_one_and_two_hybrid_ones(model_type):
    """Zamba builds a layer per entry of its layer-type list, not ``num_hidden_layers`` (the
    default list: 76 and 54 layers, a row past 600 CPU-s): three layers, a Mamba one and two
    hybrid ones (which share an attention block)."""
    import torch
    from transformers.models.auto import modeling_auto

    from ngdist import zoo_sweep_hf as hf

    name = modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]
    with torch.device("meta"):
        model = getattr(hf._transformers(), name)(hf.tiny_config(model_type))
    layers = model.model.layers
    assert [type(layer).__name__.endswith("HybridLayer") for layer in layers] == \
        [False, True, True]


def _agree(name: str) -> tuple[Any, dict[str, np.ndarray]]:
    """The case's module and feeds, after checking that its loss is finite and the same in
    float32 and in float64 (the oracle)."""
    import torch
    from sweep_check import _tensors, loss_of, to_float64

    from ngdist import zoo_sweep_hf as hf

    task, model_type = name.split("/")[1:]
    module, feeds, loss_fn = hf._build(task, model_type)
    with torch.no_grad():
        loss32 = float(loss_of(copy.deepcopy(module), loss_fn, _tensors(feeds)))
        loss64 = float(loss_of(to_float64(copy.deepcopy(module)), loss_fn,
                               _tensors(feeds, True)))
    assert np.isfinite(loss64) and abs(loss32 - loss64) <= 1e-5 * max(1.0, abs(loss64))
    return module, feeds


@pytest.mark.parametrize("name", [
    "hf/causal/dbrx", "hf/causal/gemma3n_text", "hf/causal/kimi_linear", "hf/seq2seq/t5gemma",
    "hf/seqcls/lilt", "hf/seqcls/layoutlmv3", "hf/seq2seq/nemo_speechlm", "hf/seqcls/mra",
    "hf/seq2seq/musicflamingo", "hf/seq2seq/moss_transcribe_diarize",
    "hf/speech2seq/vibevoice_asr", "hf/causal/dots1", "hf/causal/emu3", "hf/imgcls/textnet",
    "hf/seqcls/mistral4", "hf/causal/gemma4", "hf/causal/gemma3n", "hf/causal/lfm2_moe"])
def test_a_tiny_config_its_default_did_not_build_runs_in_float32_and_float64(name):
    """Each raised before its tiny config's fix: DBRX's attention sub-config had no rotary
    base and no clip, Gemma 3n shared the caches of 15 of its 2 layers, Kimi Linear routed to
    8 of 4 experts, T5Gemma's cross-attention read 2304 features of a 32-wide encoder, LiLT's
    and LayoutLMv3's box embeddings were not as wide as the model, Nemotron transcribe's
    diarization head read 512 features of 32 (and its 52-layer text model held 17 M
    parameters), MRA's float64 oracle met its float32 attention output, MusicFlamingo's and
    MOSS's audio features were asked for without their placeholders and unused padding
    mask, VibeVoice's audio tokenizers held 170 M parameters and drew noise on its latents
    (float32 and float64 losses 4e-3 apart), dots.llm1 had no shared-expert count, Emu3's
    causal LM was given the multimodal config (not its text config, as Auto gives it),
    TextNet's stem was 64 channels for a 32-channel stage, Mistral 4's rotary table half its
    rope part, and Gemma 4, without an audio tower, was fed audio features; Gemma 3n's text
    model shared the caches of 15 of its 2 layers, its audio encoder was fed an int64 frame
    mask it inverts as bool, and its audio and vision hard tokens lay past the tiny
    vocabulary; LFM2-MoE's default config names no layer types."""
    _agree(name)


@pytest.mark.parametrize("name", ["hf/causal/dots3_note_text", "hf/causal/dots3_note"])
def test_a_heterogeneous_configs_per_layer_attention_is_shrunk_and_rotates_its_rope_part(name):
    """dots3 note sets each sliding-window layer's latent attention per layer (a global read
    of one raises): the overrides are shrunk with the config; one indexed and one sliding
    layer, each layer type's rotary table as wide as its rope part (the default's rotary
    fraction, 0.25 of the shrunk 8-wide head, gave a 2-wide table that torch broadcast over
    the rope part silently)."""
    module, _ = _agree(name)
    model = module.model.model
    assert sorted(model.config.layer_types) == ["indexed_attention", "sliding_attention"]
    for layer in model.layers:
        kind = model.config.layer_types[layer.self_attn.layer_idx]
        table = getattr(model.rotary_emb, f"{kind}_inv_freq")
        assert 2 * table.numel() == layer.self_attn.qk_rope_head_dim


def test_patchified_images_and_an_image_prompt_are_fed_as_their_processors_give_them():
    """SigLIP2 takes patches already cut (a linear patch embedding of 192 features was fed
    32-pixel images): 16 patches a sample, the last image 2 x 4 patches and padding.
    ShieldGemma 2 reads a prompt with the image's placeholders and scores 2 tokens."""
    from ngdist import zoo_sweep_hf as hf

    _, feeds = _agree("hf/imgcls/siglip2")
    assert feeds["pixel_values"].shape == (hf.BATCH, 16, 3 * 8 * 8)
    assert feeds["spatial_shapes"].tolist()[-1] == [2, 4]
    assert feeds["pixel_attention_mask"].sum(1).tolist() == [16] * (hf.BATCH - 1) + [8]
    module, feeds = _agree("hf/imgcls/shieldgemma2")
    image = module.model.config.image_token_id
    assert ((feeds["input_ids"] == image).sum(1) == module.model.config.mm_tokens_per_image).all()
    assert set(feeds["y"].tolist()) <= {0, 1}


def test_a_streaming_audio_lm_gets_one_audio_embedding_per_token():
    """Voxtral Realtime adds each step's audio embedding to its token's (4 embeddings met 8
    tokens): the features hold as many frames as give one embedding per token."""
    import torch

    from ngdist import zoo_sweep_hf as hf

    module, feeds = _agree("hf/speech2seq/voxtral_realtime")
    with torch.no_grad():
        audio = module.model.get_audio_features(torch.from_numpy(feeds["input_features"]))
    assert audio.pooler_output.shape[1] == feeds["input_ids"].shape[1] == hf.LENGTH


def test_an_audio_lm_that_counts_its_audio_embeddings_from_a_sample_mask_is_fed_one():
    """VibeVoice's get_audio_features is its inner model's, and counts the audio embeddings
    from a mask of the waveform's samples (it was fed as a text model: float waveforms as
    token ids): the waveform, its all-ones mask, one placeholder per embedding."""
    from ngdist import zoo_sweep_hf as hf
    from ngdist.zoo_sweep_configs import AUDIO_TOKEN

    module, feeds = _agree("hf/speech2seq/vibevoice")
    assert feeds["padding_mask"].shape == feeds["input_values"].shape[::2]
    assert feeds["padding_mask"].all()
    hop = module.model.config.audio_config.hop_length
    assert ((feeds["input_ids"] == AUDIO_TOKEN).sum(1) == 1600 // hop).all()


def test_nemotron_transcribes_speech_encoders_take_a_padding_mask():
    """Nemotron transcribe's speech encoders project values for every head but keys for
    ``num_key_value_heads``: 2 (the sweep's) made a padding mask's repeat of the values 8
    heads of 4 keys, and a batch whose last audio is padded failed (as did the export, which
    keeps the mask). With as many kv heads as heads, its audio features count the padded
    sample's frames only."""
    import torch

    from ngdist import zoo_sweep_hf as hf

    module, feeds, _ = hf._build("seq2seq", "nemo_speechlm")
    mask = feeds["input_features_mask"].copy()
    mask[-1, -8:] = 0  # the last audio 8 frames (one encoder frame) shorter
    with torch.no_grad():
        out = module.model.get_audio_features(torch.from_numpy(feeds["input_features"]),
                                              torch.from_numpy(mask))
    per_sample = mask.shape[1] // 8
    assert out.pooler_output.shape[0] == hf.BATCH * per_sample - 1
