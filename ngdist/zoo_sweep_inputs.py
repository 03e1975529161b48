"""The model sweep's Hugging Face batches and loss wrappers (``ngdist.zoo_sweep_hf`` builds the
cases): padded token batches and their labels, the module that returns logits or the
token-level cross-entropy people write (``Logits``), and the inputs of audio models: waveforms
or feature maps for classifiers and encoder-decoders, and audio language models' features with
one placeholder token per audio embedding."""
from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ngdist.errors import ArgumentError
from ngdist.zoo_sweep import _torch
from ngdist.zoo_sweep_configs import AUDIO_TOKEN, BATCH, LENGTH, PAD, VOCAB


def token_batch(rng: np.random.Generator, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (3..vocab-1) ending in the end-of-sequence token (2, as a tokenizer adds:
    BART's classification head reads it) and an attention mask; the last sequence
    right-padded by 2."""
    ids = rng.integers(3, vocab, (BATCH, LENGTH)).astype(np.int64)
    mask = np.ones_like(ids)
    ids[:-1, -1], ids[-1, -3] = 2, 2
    ids[-1, -2:], mask[-1, -2:] = PAD, 0
    return ids, mask


def token_labels(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    return np.where(mask == 1, ids, -100).astype(np.int64)


def vocab_size(model: Any) -> int:
    return int(model.get_output_embeddings().weight.shape[0]) \
        if model.get_output_embeddings() is not None else model.config.vocab_size


class Logits:
    """``forward(*inputs)`` -> the model's logits; with ``tokens``, ``forward(*inputs, y)`` ->
    the cross-entropy of the logits flattened over the tokens against the flattened labels
    ``y`` (-100: not counted), as people write a language model's loss."""

    @staticmethod
    def wrap(model: Any, names: list[str], shift: bool = False, tokens: bool = False) -> Any:
        torch = _torch()
        # VibeVoice draws noise onto its audio latents unless told not to: off, like dropout
        fixed = {"sample": False} if takes(model, "sample") else {}

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


def audio_feeds(model: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The main audio input: a waveform of 1600 samples, or a feature map the config's
    size (mel bins by 2 * max_source_positions frames, or frames by features; a model whose
    main input is token ids and that takes ``input_features`` as its encoder's input
    embeddings, Pop2Piano: frames by d_model)."""
    name = model.main_input_name
    if name == "inputs":  # SpeechEncoderDecoder: its encoder's input, passed as ``inputs``
        return {"inputs": next(iter(audio_feeds(model.encoder, rng).values()))}
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


def is_audio_lm(model: Any) -> bool:
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


def audio_lm(model: Any, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray], Any]:
    """The audio embeddings' placeholders, then text (the last sequence right-padded); the
    loss over the next text token, audio positions and padding not counted (-100)."""
    audio, n = _tower_features(model, rng) if _masked_tower(model) else \
        _audio_features(model, rng)
    ids, mask = token_batch(rng, VOCAB)
    ids[ids == AUDIO_TOKEN] = AUDIO_TOKEN - 1
    ids = np.concatenate([np.full((BATCH, n), AUDIO_TOKEN, np.int64), ids], 1)
    mask = np.concatenate([np.ones((BATCH, n), np.int64), mask], 1)
    labels = token_labels(ids, mask)
    labels[:, :n] = -100
    feeds = {"input_ids": ids, "attention_mask": mask, **audio,
             "y": labels[:, 1:].reshape(-1)}
    return Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None


# streaming audio language models: each step's audio embedding added to its token's
STREAMING = {"voxtral_realtime"}


def streaming_audio_lm(model: Any, rng: np.random.Generator
                        ) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Voxtral Realtime adds the audio embedding of each step to that step's token embedding
    (no placeholders): features (mel bins by frames) of as many frames as give one audio
    embedding per token, the frames per embedding read from one run of its audio tower;
    the loss over the next token, padding not counted."""
    probe, n = _audio_features(model, rng)
    bins, frames = probe["input_features"].shape[1:]
    ids, mask = token_batch(rng, VOCAB)
    features = rng.standard_normal((BATCH, bins, frames * LENGTH // n)).astype(np.float32)
    feeds = {"input_ids": ids, "attention_mask": mask, "input_features": features,
             "y": token_labels(ids, mask)[:, 1:].reshape(-1)}
    return Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None


def takes(model: Any, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters
