"""The model sweep's Hugging Face cases: one tiny config (random init, nothing downloaded) per
architecture family (``model_type``) of each of AutoModelForCausalLM,
AutoModelForSequenceClassification, AutoModelForSeq2SeqLM, AutoModelForImageClassification,
AutoModelForAudioClassification and AutoModelForSpeechSeq2Seq, wrapped so that its forward
returns logits for ``nn.CrossEntropyLoss()``, or, for token-level tasks, the loss people
write there, ``F.cross_entropy(logits.reshape(-1, V), labels, ignore_index=-100)`` (compiled with
``loss=None``: the labels are the module's last input):

* causal LM: ``logits[:, :-1]`` flattened against ``input_ids[:, 1:].reshape(-1)``, the
  last sequence right-padded by 2 tokens (``attention_mask`` 0, labels -100 there,
  ``pad_token_id`` 0, which is the embeddings' ``padding_idx`` where the model sets one);
* sequence classification: the same padded batch, 3 labels, one a sequence;
* seq2seq and speech seq2seq: the decoder fed the labels shifted right, logits flattened
  over the tokens, padded target positions -100;
* image and audio classification: logits of a small image or a short waveform / feature map
  (patches already cut, SigLIP2; a prompt holding the image's placeholders, ShieldGemma 2);
* audio language models (audio features in, no decoder_input_ids: Granite Speech,
  AudioFlamingo3, ...): one placeholder token per audio embedding, then the padded text, the
  loss over the next text token (a streaming one, Voxtral Realtime: one embedding per token);
* decoders over several code streams (Dia): decoder_input_ids of (batch, time, streams),
  labels flattened over the (sample, stream) rows of the logits.

A mixture of experts' router that the model initialises to zero (afmoe) is drawn from
N(0, 0.02) instead: at zero every expert ties, and torch and onnxruntime break top-k ties
differently (torch.topk picks the last indices, onnxruntime's TopK the first).

The tiny configs are ``ngdist.zoo_sweep_configs``' and ``ngdist.zoo_sweep_fixups``'.
"""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ngdist.errors import ArgumentError
from ngdist.zoo_sweep import Case, _no_dropout, _torch
from ngdist.zoo_sweep_configs import AUDIO_TOKEN, BATCH, LABELS, LENGTH, PAD, VOCAB
from ngdist.zoo_sweep_configs import transformers as _transformers
from ngdist.zoo_sweep_float64 import after_build, before_build
from ngdist.zoo_sweep_fixups import tiny_config

TASKS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seqcls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "imgcls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audiocls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "speech2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}


def hf_families(task: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    _transformers()
    return sorted(getattr(modeling_auto, TASKS[task]))


def _model(task: str, model_type: str) -> Any:
    tf = _transformers()
    from transformers.models.auto import modeling_auto

    name = getattr(modeling_auto, TASKS[task])[model_type]
    cls = getattr(tf, name[0] if isinstance(name, tuple) else name)  # deit: (plain, teacher)
    cfg = tiny_config(model_type)
    if getattr(cls, "config_class", None) is getattr(cfg, "sub_configs", {}).get("text_config"):
        cfg = cfg.get_text_config()  # a text model of a multimodal config, as Auto's swap
    torch = _torch()
    before_build(model_type)
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # a zero router ties every expert: see the module's docstring
        for name, param in model.named_parameters():
            if ("router" in name or "gate" in name) and param.ndim > 1 and \
                    not param.any():
                param.normal_(0.0, 0.02)
    after_build(model_type, model)
    return _no_dropout(model)


def _tokens(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (3..vocab-1) ending in the end-of-sequence token (2, as a tokenizer adds:
    BART's classification head reads it) and an attention mask; the last sequence
    right-padded by 2."""
    ids = rng.integers(3, vocab, (BATCH, LENGTH)).astype(np.int64)
    mask = np.ones_like(ids)
    ids[:-1, -1], ids[-1, -3] = 2, 2
    ids[-1, -2:], mask[-1, -2:] = PAD, 0
    return ids, mask


def _labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.where(mask == 1, ids, -100).astype(np.int64)


def _vocab(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0]) \
        if model.get_output_embeddings() is not None else model.config.vocab_size


class _Logits:
    """``forward(*inputs)`` -> the model's logits; with ``tokens``, ``forward(*inputs, y)`` ->
    the cross-entropy of the logits flattened over the tokens against the flattened labels
    ``y`` (-100: not counted), as people write a language model's loss."""

    @staticmethod
    def wrap(model: Any, names: list[str], shift: bool = False, tokens: bool = False) -> Any:
        torch = _torch()
        # VibeVoice draws noise onto its audio latents unless told not to: off, like dropout
        fixed = {"sample": False} if _takes(model, "sample") else {}

        class Logits(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, a, b=None, c=None, d=None, e=None):  # named: what people
                # write, and what both exporters take (dynamo matches *args to one input)
                inputs = [v for v in (a, b, c, d, e) if v is not None]
                if tokens:
                    *inputs, y = inputs
                out = self.model(**dict(zip(names, inputs)), **fixed)
                # PP-LCNet returns its class scores as last_hidden_state
                logits = getattr(out, "logits", None)
                logits = out.last_hidden_state if logits is None else logits
                if not tokens:
                    return logits
                logits = logits[:, :-1] if shift else logits
                return torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y, ignore_index=-100)

        return Logits().train()


def _audio_feeds(model: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The main audio input: a waveform of 1600 samples, or a feature map the config's
    size (mel bins by 2 * max_source_positions frames, or frames by features; a model whose
    main input is token ids and that takes ``input_features`` as its encoder's input
    embeddings, Pop2Piano: frames by d_model)."""
    name = model.main_input_name
    if name == "inputs":  # SpeechEncoderDecoder: its encoder's input, passed as ``inputs``
        return {"inputs": next(iter(_audio_feeds(model.encoder, rng).values()))}
    cfg = model.config
    embeds = name not in ("input_values", "input_features") and \
        "input_features" in inspect.signature(model.forward).parameters
    if embeds:
        name = "input_features"
    if name == "input_values":
        if hasattr(cfg, "max_length") and hasattr(cfg, "num_mel_bins"):  # AST
            shape: tuple[int, ...] = (BATCH, cfg.max_length, cfg.num_mel_bins)
        else:
            shape = (BATCH, 1600)
    elif hasattr(cfg, "max_source_positions") and hasattr(cfg, "num_mel_bins"):
        shape = (BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    elif embeds:
        shape = (BATCH, 32, cfg.d_model)
    else:  # wav2vec2-bert, seamless_m4t: stacked frames, the projection's input width
        feat = getattr(cfg, "feature_projection_input_dim", None) or getattr(
            cfg, "input_feat_per_channel", getattr(cfg, "feature_size", 16))
        shape = (BATCH, 32, feat * getattr(cfg, "input_channels", 1))
    return {name: rng.standard_normal(shape).astype(np.float32)}


def _is_audio_lm(model: Any) -> bool:
    """A decoder-only language model that reads audio through placeholder tokens (Granite
    Speech, AudioFlamingo3, OmniASR, ...): audio features or a waveform in, no
    decoder_input_ids. Not one whose optional audio tower its config leaves out (Gemma 4)."""
    if getattr(model.config, "audio_config", True) is None:
        return False
    params = inspect.signature(model.forward).parameters
    return ("input_features" in params or "input_values" in params) \
        and "decoder_input_ids" not in params and (_audio_getter(model) is not None or
                                                   _masked_tower(model))


def _masked_tower(model: Any) -> bool:
    """An audio language model whose forward runs its audio tower itself on features and a
    frame mask (Qwen2-Audio: no get_audio_features)."""
    return hasattr(getattr(model, "model", None), "audio_tower") and \
        "feature_attention_mask" in inspect.signature(model.forward).parameters


def _tower_features(model: Any, rng: np.random.Generator
                    ) -> tuple[dict[str, np.ndarray], int]:
    """(features of 2 * max_source_positions frames and their all-ones frame mask, the
    audio embeddings per sample the tower's length rule gives for them)."""
    torch = _torch()
    cfg = model.config.audio_config
    frames = 2 * cfg.max_source_positions
    feeds = {"input_features": rng.standard_normal((BATCH, cfg.num_mel_bins, frames))
             .astype(np.float32),
             "feature_attention_mask": np.ones((BATCH, frames), np.int64)}
    _, lengths = model.model.audio_tower._get_feat_extract_output_lengths(torch.tensor(frames))
    return feeds, int(lengths)


def _audio_getter(model: Any) -> Any:
    """``get_audio_features`` of the model, or of its inner model (VibeVoice's is there only)."""
    return getattr(model, "get_audio_features", None) or \
        getattr(getattr(model, "model", None), "get_audio_features", None)


def _probe_inputs(model: Any, params: Any, frames: int
                  ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], dict[str, Any]]:
    """What get_audio_features takes after the audio: (masks the model is fed too: a frame
    mask, or VibeVoice's sample mask, from which it counts its audio embeddings; placeholder
    ids, MusicFlamingo's audio timestamps; keywords: MOSS's padding mask, required but not
    read, None as its forward passes it)."""
    fed: dict[str, np.ndarray] = {}
    extra: dict[str, np.ndarray] = {}
    if "input_features_mask" in params:
        fed["input_features_mask"] = np.ones((BATCH, frames), np.int64)
    padding = params.get("padding_mask")
    if padding is not None and padding.default is inspect.Parameter.empty:
        fed["padding_mask"] = np.ones((BATCH, frames), np.bool_)
    if "input_ids" in params:
        _, n = model.model.audio_tower._get_feat_extract_output_lengths(_torch().tensor(frames))
        extra["input_ids"] = np.full((BATCH, int(n)), AUDIO_TOKEN, np.int64)
    inner = inspect.signature(getattr(model, "model", model).get_audio_features).parameters
    unused = {"padding_mask": None} if "padding_mask" in inner and padding is None else {}
    return fed, extra, unused


def _audio_features(model: Any, rng: np.random.Generator
                    ) -> tuple[dict[str, np.ndarray], int]:
    """(the audio inputs, the audio embeddings per sample): a waveform of 1600 samples (with
    or without a channel axis), or a feature map in the layout the audio encoder takes
    (features by frames or frames by features; 2 * max_source_positions frames, or one
    chunk, 2 * n_window, where the encoder takes whole chunks), and the masks
    get_audio_features takes (``_probe_inputs``; a frame mask int64, else bool: Gemma 3n)."""
    torch = _torch()
    cfg = model.config
    sub = getattr(cfg, "audio_config", None) or getattr(cfg, "encoder_config", None) or cfg
    sub = getattr(sub, "asr_config", None) or sub  # Nemotron transcribe: its ASR encoder's
    getter = _audio_getter(model)
    params = inspect.signature(getter).parameters
    if "args" in params and hasattr(model, "model"):  # a delegate: its target's signature
        params = inspect.signature(model.model.get_audio_features).parameters
    if "input_values" in inspect.signature(model.forward).parameters:
        key, frames = "input_values", 1600
        shapes: tuple[tuple[int, ...], ...] = ((BATCH, 1, frames), (BATCH, frames))
    else:
        width = next(getattr(sub, k) for k in ("input_size", "input_dim", "input_feat_size",
                                                "num_mel_bins") if getattr(sub, k, None))
        frames = 2 * getattr(sub, "n_window", getattr(sub, "max_source_positions", 16))
        key, shapes = "input_features", ((BATCH, width, frames), (BATCH, frames, width))
    fed, extra, unused = _probe_inputs(model, params, frames)
    failures = []
    for shape, kind in [(s, k) for s in shapes for k in (np.int64, np.bool_)]:
        feeds = {key: rng.standard_normal(shape).astype(np.float32),
                 **{k: v.astype(kind) if k == "input_features_mask" else v for k, v in fed.items()}}
        try:
            with torch.no_grad():
                out = getter(*map(torch.from_numpy, [*feeds.values(), *extra.values()]),
                             **unused)
        except (RuntimeError, ValueError) as exc:
            failures.append(f"{shape}: {exc}")
            continue
        pooled = getattr(out, "pooler_output", out)
        return feeds, int(pooled.numel() // (BATCH * pooled.shape[-1]))
    raise ArgumentError(f"{type(model).__name__}: no audio feature layout runs: {failures}")


def _audio_lm(model: Any, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray], Any]:
    """The audio embeddings' placeholders, then text (the last sequence right-padded); the
    loss over the next text token, audio positions and padding not counted (-100)."""
    audio, n = _tower_features(model, rng) if _masked_tower(model) else \
        _audio_features(model, rng)
    ids, mask = _tokens(rng, VOCAB)
    ids[ids == AUDIO_TOKEN] = AUDIO_TOKEN - 1
    ids = np.concatenate([np.full((BATCH, n), AUDIO_TOKEN, np.int64), ids], 1)
    mask = np.concatenate([np.ones((BATCH, n), np.int64), mask], 1)
    labels = _labels(ids, mask)
    labels[:, :n] = -100
    feeds = {"input_ids": ids, "attention_mask": mask, **audio,
             "y": labels[:, 1:].reshape(-1)}
    return _Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None


# streaming audio language models: each step's audio embedding added to its token's
_STREAMING = {"voxtral_realtime"}


def _streaming_audio_lm(model: Any, rng: np.random.Generator
                        ) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Voxtral Realtime adds the audio embedding of each step to that step's token embedding
    (no placeholders): features (mel bins by frames) of as many frames as give one audio
    embedding per token, the frames per embedding read from one run of its audio tower;
    the loss over the next token, padding not counted."""
    probe, n = _audio_features(model, rng)
    bins, frames = probe["input_features"].shape[1:]
    ids, mask = _tokens(rng, VOCAB)
    features = rng.standard_normal((BATCH, bins, frames * LENGTH // n)).astype(np.float32)
    feeds = {"input_ids": ids, "attention_mask": mask, "input_features": features,
             "y": _labels(ids, mask)[:, 1:].reshape(-1)}
    return _Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None


def _channels(model: Any) -> int:
    """Codebooks of a decoder over several token streams (Dia's audio codes), else 0."""
    return int(getattr(getattr(model.config, "decoder_config", None), "num_channels", 0) or 0)


def _multichannel_seq2seq(model: Any, rng: np.random.Generator
                          ) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Text in, ``channels`` streams of codes out: decoder_input_ids shaped (batch, time,
    channels); the logits' rows are (batch, channel) pairs, flattened against the codes in
    that order."""
    cfg = model.config
    ids, mask = _tokens(rng, min(cfg.encoder_config.vocab_size, VOCAB))
    codes = rng.integers(3, min(cfg.decoder_config.vocab_size, VOCAB),
                         (BATCH, LENGTH, _channels(model))).astype(np.int64)
    start = np.full((BATCH, 1, codes.shape[2]), cfg.bos_token_id, np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask,
             "decoder_input_ids": np.concatenate([start, codes[:, :-1]], 1),
             "y": codes.transpose(0, 2, 1).reshape(-1)}
    return _Logits.wrap(model, list(feeds)[:-1], tokens=True), feeds, None


def _codes(model: Any) -> bool:
    """A decoder-only model over text and audio code streams in one sequence (Kyutai STT)."""
    return hasattr(model.config, "codebook_vocab_size") and \
        "decoder_input_ids" not in inspect.signature(model.forward).parameters


def _codes_lm(model: Any, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray], Any]:
    """input_ids of (batch, time, 1 + streams): the text token, then each stream's audio
    code; the loss over the next text token, padding not counted."""
    cfg = model.config
    ids, mask = _tokens(rng, VOCAB)
    codes = rng.integers(0, cfg.codebook_vocab_size - 1, (BATCH, LENGTH, cfg.num_codebooks))
    feeds = {"input_ids": np.concatenate([ids[..., None], codes], 2), "attention_mask": mask,
             "y": _labels(ids, mask)[:, 1:].reshape(-1)}
    return _Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None


def _takes(model: Any, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def _patches(model: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Patches already cut from the images (SigLIP2, NaFlex: a processor keeps each image's
    aspect ratio): up to 16 patches a sample, flattened to channels x patch x patch, a grid of
    4 x 4 patches, the last image's 2 x 4 and padding (``pixel_attention_mask`` 0); the grid
    of each in ``spatial_shapes``."""
    vision = model.config.vision_config
    width = vision.num_channels * vision.patch_size ** 2
    shapes = np.array([[4, 4]] * (BATCH - 1) + [[2, 4]], np.int64)
    mask = (np.arange(16)[None] < shapes.prod(1)[:, None]).astype(np.int64)
    pixels = rng.standard_normal((BATCH, 16, width)).astype(np.float32) * mask[..., None]
    return {"pixel_values": pixels.astype(np.float32), "pixel_attention_mask": mask,
            "spatial_shapes": shapes}


def _image_prompt(model: Any, rng: np.random.Generator
                  ) -> tuple[Any, dict[str, np.ndarray], Any]:
    """An image classifier that reads a prompt with the image in it (ShieldGemma 2): the
    image's placeholder tokens (``mm_tokens_per_image``), then the prompt's text; the label
    one of its scores (yes or no: 2)."""
    cfg = model.config
    ids, mask = _tokens(rng, VOCAB)
    ids[ids == cfg.image_token_id] = cfg.image_token_id - 1
    n = cfg.mm_tokens_per_image
    feeds = {"input_ids": np.concatenate([np.full((BATCH, n), cfg.image_token_id), ids], 1),
             "attention_mask": np.concatenate([np.ones((BATCH, n), np.int64), mask], 1)}
    vision = cfg.vision_config
    feeds["pixel_values"] = rng.standard_normal(
        (BATCH, vision.num_channels, vision.image_size, vision.image_size)).astype(np.float32)
    feeds["y"] = rng.integers(0, 2, BATCH).astype(np.int64)
    return _Logits.wrap(model, list(feeds)[:-1]), feeds, _torch().nn.CrossEntropyLoss()


# models whose forward takes an attention_mask and ignores it: the exported graph has no such
# input, and a trainer refuses a batch with one (recurrent language models; MRA, whose
# attention without its CUDA kernel is zeros in transformers)
_MASKLESS = {"rwkv", "xlstm", "mra"}


def _build(task: str, model_type: str) -> tuple[Any, dict[str, np.ndarray], Any]:
    torch = _torch()
    model = _model(task, model_type)
    rng = np.random.default_rng(0)
    if task == "imgcls" and _takes(model, "input_ids") and _takes(model, "pixel_values"):
        return _image_prompt(model, rng)
    if task in ("imgcls", "audiocls"):
        if task == "imgcls" and model.main_input_name == "input_ids":  # ImageGPT: pixels
            feeds = {"input_ids": rng.integers(0, min(_vocab(model), VOCAB), (BATCH, LENGTH))
                     .astype(np.int64)}  # as colour-cluster tokens
        elif task == "imgcls" and _takes(model, "spatial_shapes"):
            feeds = _patches(model, rng)
        elif task == "imgcls":
            vision = getattr(model.config, "vision_config", None) or model.config  # siglip
            side = getattr(vision, "image_size", 32)
            side = side[0] if isinstance(side, (list, tuple)) else side
            chans = getattr(vision, "num_channels", 3)
            feeds = {"pixel_values": rng.standard_normal((BATCH, chans, side, side))
                     .astype(np.float32)}
        else:
            feeds = _audio_feeds(model, rng)
        feeds["y"] = rng.integers(0, LABELS, BATCH).astype(np.int64)
        return _Logits.wrap(model, list(feeds)[:-1]), feeds, torch.nn.CrossEntropyLoss()
    if model_type in _STREAMING:
        return _streaming_audio_lm(model, rng)
    if _is_audio_lm(model):
        return _audio_lm(model, rng)
    if _channels(model):
        return _multichannel_seq2seq(model, rng)
    if _codes(model):
        return _codes_lm(model, rng)
    # canine reads characters (hashed code points): no vocabulary of its own
    vocab = _vocab(model) if task != "seqcls" else getattr(model.config, "vocab_size", VOCAB)
    ids, mask = _tokens(rng, min(vocab, VOCAB))
    if task == "causal":
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "y": _labels(ids, mask)[:, 1:].reshape(-1)}
        if model_type in _MASKLESS:
            del feeds["attention_mask"]
        return _Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None
    if task == "seqcls":
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "y": rng.integers(0, LABELS, BATCH).astype(np.int64)}
        if model_type in _MASKLESS:
            del feeds["attention_mask"]
        return _Logits.wrap(model, list(feeds)[:-1]), feeds, torch.nn.CrossEntropyLoss()
    target, tmask = _tokens(rng, min(vocab, VOCAB))
    start = getattr(model.config, "decoder_start_token_id", None) or 1
    decoder = np.concatenate([np.full((BATCH, 1), start, np.int64), target[:, :-1]], 1)
    source = {"input_ids": ids, "attention_mask": mask} if task == "seq2seq" \
        else _audio_feeds(model, rng)
    feeds = {**source, "decoder_input_ids": decoder, "y": _labels(target, tmask).reshape(-1)}
    return _Logits.wrap(model, list(feeds)[:-1], tokens=True), feeds, None


def hf_cases(tasks: tuple[str, ...] = tuple(TASKS)) -> list[Case]:
    return [Case(f"hf/{task}/{mt}", f"hf/{task}/{mt}", "transformers",
                 lambda t=task, m=mt: _build(t, m))
            for task in tasks for mt in hf_families(task)]
