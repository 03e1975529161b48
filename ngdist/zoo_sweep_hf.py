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
  labels flattened over the (sample, stream) rows of the logits; MusicGen's causal LM: each
  stream's rows of input_ids, the next code of each stream its label.

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
from ngdist.zoo_sweep_configs import BATCH, LABELS, LENGTH, VOCAB
from ngdist.zoo_sweep_configs import transformers as _transformers
from ngdist.zoo_sweep_float64 import after_build, before_build
from ngdist.zoo_sweep_fixups import tiny_config
from ngdist.zoo_sweep_inputs import (STREAMING, Logits, audio_feeds, audio_lm, is_audio_lm,
                                     streaming_audio_lm, takes, token_batch, token_labels,
                                     vocab_size)

# speculative-decoding drafters: their forward reads the target model's embeddings and its
# keys and values (shared_kv_states), not token ids; they do not train alone
DRAFTERS = ("gemma4_assistant", "gemma4_unified_assistant")
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
    if model_type in DRAFTERS:
        raise ArgumentError(f"not built: {model_type} is a speculative-decoding drafter (its "
                            "forward reads the target model's inputs_embeds and "
                            "shared_kv_states)")
    tf = _transformers()
    from transformers.models.auto import modeling_auto

    name = getattr(modeling_auto, TASKS[task])[model_type]
    cls = getattr(tf, name[0] if isinstance(name, tuple) else name)  # deit: (plain, teacher)
    cfg = tiny_config(model_type)
    sub = next((key for key, kind in getattr(cfg, "sub_configs", {}).items()
                if kind is getattr(cls, "config_class", None)), None)
    if sub is not None:  # a text model of a multimodal config (MusicGen's decoder), as Auto
        cfg = getattr(cfg, sub)
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
    if hasattr(model, "set_default_language"):  # X-MOD: adapters per language, one chosen
        model.set_default_language(model.config.languages[0])
    return _no_dropout(model)


def _channels(model: Any) -> int:
    """Codebooks of a decoder over several token streams (Dia's audio codes), else 0."""
    return int(getattr(getattr(model.config, "decoder_config", None), "num_channels", 0) or 0)


def _multichannel_seq2seq(model: Any, rng: np.random.Generator
                          ) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Text in, ``channels`` streams of codes out: decoder_input_ids shaped (batch, time,
    channels); the logits' rows are (batch, channel) pairs, flattened against the codes in
    that order."""
    cfg = model.config
    ids, mask = token_batch(rng, min(cfg.encoder_config.vocab_size, VOCAB))
    codes = rng.integers(3, min(cfg.decoder_config.vocab_size, VOCAB),
                         (BATCH, LENGTH, _channels(model))).astype(np.int64)
    start = np.full((BATCH, 1, codes.shape[2]), cfg.bos_token_id, np.int64)
    feeds = {"input_ids": ids, "attention_mask": mask,
             "decoder_input_ids": np.concatenate([start, codes[:, :-1]], 1),
             "y": codes.transpose(0, 2, 1).reshape(-1)}
    return Logits.wrap(model, list(feeds)[:-1], tokens=True), feeds, None


def _codes(model: Any) -> bool:
    """A decoder-only model over text and audio code streams in one sequence (Kyutai STT)."""
    return hasattr(model.config, "codebook_vocab_size") and \
        "decoder_input_ids" not in inspect.signature(model.forward).parameters


def _codes_lm(model: Any, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray], Any]:
    """input_ids of (batch, time, 1 + streams): the text token, then each stream's audio
    code; the loss over the next text token, padding not counted."""
    cfg = model.config
    ids, mask = token_batch(rng, VOCAB)
    codes = rng.integers(0, cfg.codebook_vocab_size - 1, (BATCH, LENGTH, cfg.num_codebooks))
    feeds = {"input_ids": np.concatenate([ids[..., None], codes], 2), "attention_mask": mask,
             "y": token_labels(ids, mask)[:, 1:].reshape(-1)}
    return Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None


def _codebook_heads(model: Any) -> int:
    """Codebooks of a decoder with one head each over parallel code streams (MusicGen's
    causal LM: input_ids and logits of (batch * codebooks, time, ...)), else 0."""
    return int(getattr(model.config, "num_codebooks", 0) or 0) \
        if isinstance(getattr(model, "lm_heads", None), _torch().nn.ModuleList) else 0


def _codebook_lm(model: Any, rng: np.random.Generator
                 ) -> tuple[Any, dict[str, np.ndarray], Any]:
    """Each stream's codes fed as its rows of input_ids, the next code of each its label,
    flattened in the logits' (sample, codebook, time) order."""
    k = _codebook_heads(model)
    codes = rng.integers(0, min(model.config.vocab_size, VOCAB), (BATCH, k, LENGTH + 1))
    feeds = {"input_ids": codes[..., :-1].reshape(BATCH * k, LENGTH).astype(np.int64),
             "y": codes[..., 1:].reshape(-1).astype(np.int64)}
    return Logits.wrap(model, ["input_ids"], tokens=True), feeds, None


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
    ids, mask = token_batch(rng, VOCAB)
    ids[ids == cfg.image_token_id] = cfg.image_token_id - 1
    n = cfg.mm_tokens_per_image
    feeds = {"input_ids": np.concatenate([np.full((BATCH, n), cfg.image_token_id), ids], 1),
             "attention_mask": np.concatenate([np.ones((BATCH, n), np.int64), mask], 1)}
    vision = cfg.vision_config
    feeds["pixel_values"] = rng.standard_normal(
        (BATCH, vision.num_channels, vision.image_size, vision.image_size)).astype(np.float32)
    feeds["y"] = rng.integers(0, 2, BATCH).astype(np.int64)
    return Logits.wrap(model, list(feeds)[:-1]), feeds, _torch().nn.CrossEntropyLoss()


# models whose forward takes an attention_mask and ignores it: the exported graph has no such
# input, and a trainer refuses a batch with one (recurrent language models; MRA, whose
# attention without its CUDA kernel is zeros in transformers)
_MASKLESS = {"rwkv", "xlstm", "mra"}


def _build(task: str, model_type: str) -> tuple[Any, dict[str, np.ndarray], Any]:
    torch = _torch()
    model = _model(task, model_type)
    rng = np.random.default_rng(0)
    if task == "imgcls" and takes(model, "input_ids") and takes(model, "pixel_values"):
        return _image_prompt(model, rng)
    if task in ("imgcls", "audiocls"):
        if task == "imgcls" and model.main_input_name == "input_ids":  # ImageGPT: pixels
            feeds = {"input_ids": rng.integers(0, min(vocab_size(model), VOCAB), (BATCH, LENGTH))
                     .astype(np.int64)}  # as colour-cluster tokens
        elif task == "imgcls" and takes(model, "spatial_shapes"):
            feeds = _patches(model, rng)
        elif task == "imgcls":
            vision = getattr(model.config, "vision_config", None) or model.config  # siglip
            side = getattr(vision, "image_size", 32)
            side = side[0] if isinstance(side, (list, tuple)) else side
            chans = getattr(vision, "num_channels", 3)
            feeds = {"pixel_values": rng.standard_normal((BATCH, chans, side, side))
                     .astype(np.float32)}
        else:
            feeds = audio_feeds(model, rng)
        feeds["y"] = rng.integers(0, LABELS, BATCH).astype(np.int64)
        return Logits.wrap(model, list(feeds)[:-1]), feeds, torch.nn.CrossEntropyLoss()
    if model_type in STREAMING:
        return streaming_audio_lm(model, rng)
    if is_audio_lm(model):
        return audio_lm(model, rng)
    if _channels(model):
        return _multichannel_seq2seq(model, rng)
    if _codes(model):
        return _codes_lm(model, rng)
    if _codebook_heads(model):
        return _codebook_lm(model, rng)
    # canine reads characters (hashed code points): no vocabulary of its own
    vocab = vocab_size(model) if task != "seqcls" else getattr(model.config, "vocab_size", VOCAB)
    ids, mask = token_batch(rng, min(vocab, VOCAB))
    if task == "causal":
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "y": token_labels(ids, mask)[:, 1:].reshape(-1)}
        if model_type in _MASKLESS:
            del feeds["attention_mask"]
        return Logits.wrap(model, list(feeds)[:-1], True, True), feeds, None
    if task == "seqcls":
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "y": rng.integers(0, LABELS, BATCH).astype(np.int64)}
        if model_type in _MASKLESS:
            del feeds["attention_mask"]
        return Logits.wrap(model, list(feeds)[:-1]), feeds, torch.nn.CrossEntropyLoss()
    target, tmask = token_batch(rng, min(vocab, VOCAB))
    start = getattr(model.config, "decoder_start_token_id", None) or 1
    decoder = np.concatenate([np.full((BATCH, 1), start, np.int64), target[:, :-1]], 1)
    source = {"input_ids": ids, "attention_mask": mask} if task == "seq2seq" \
        else audio_feeds(model, rng)
    feeds = {**source, "decoder_input_ids": decoder, "y": token_labels(target, tmask).reshape(-1)}
    return Logits.wrap(model, list(feeds)[:-1], tokens=True), feeds, None


def hf_cases(tasks: tuple[str, ...] = tuple(TASKS)) -> list[Case]:
    return [Case(f"hf/{task}/{mt}", f"hf/{task}/{mt}", "transformers",
                 lambda t=task, m=mt: _build(t, m))
            for task in tasks for mt in hf_families(task)]
