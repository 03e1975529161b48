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
* image and audio classification: logits of a small image or a short waveform / feature map;
* audio language models (audio features in, no decoder_input_ids: Granite Speech,
  AudioFlamingo3, ...): one placeholder token per audio embedding, then the padded text, the
  loss over the next text token;
* decoders over several code streams (Dia): decoder_input_ids of (batch, time, streams),
  labels flattened over the (sample, stream) rows of the logits.

A mixture of experts' router that the model initialises to zero (afmoe) is drawn from
N(0, 0.02) instead: at zero every expert ties, and torch and onnxruntime break top-k ties
differently (torch.topk picks the last indices, onnxruntime's TopK the first).

A config is made tiny by name: every attribute of a known width, depth, head count or
vocabulary name present in the config (or a sub-config) is set to a small value (latent
attention's ranks and head sizes too, with as many kv heads as heads; GroupNorm's group count
capped at 8; audio placeholder ids inside the tiny vocabulary).
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ngdist.errors import ArgumentError
from ngdist.zoo_sweep import Case, _no_dropout, _torch

TASKS = {
    "causal": "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
    "seqcls": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "imgcls": "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "audiocls": "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "speech2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
}
VOCAB, LENGTH, BATCH, LABELS, PAD = 96, 8, 3, 3, 0
AUDIO_TOKEN = VOCAB - 1  # an audio language model's placeholder, never drawn as text
WIDTH, HEADS = 32, 4
_SCALARS = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "d_embed",
                     "embedding_size", "hidden_dim", "word_embed_proj_dim"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                     "encoder_layers", "decoder_layers", "num_decoder_layers",
                     "num_encoder_layers", "decoder_num_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads", "decoder_num_attention_heads"),
                    HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
                     "d_ff", "n_inner", "decoder_intermediate_size", "mlp_dim"), 2 * WIDTH),
    "head_dim": WIDTH // HEADS, "d_kv": WIDTH // HEADS, "vocab_size": VOCAB,
    "max_position_embeddings": 64, "model_max_length": 64, "n_positions": 64,
    "linear_head_dim": WIDTH // HEADS, "max_source_positions": 16,
    "max_target_positions": 64, "image_size": 64, "patch_size": 8,
    "pad_token_id": PAD, "bos_token_id": 1, "eos_token_id": 2, "decoder_start_token_id": 1,
    "num_mel_bins": 16, "use_cache": False,
    "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_routed_experts": 4,
    "moe_intermediate_size": WIDTH, "first_k_dense_replace": 1,
    "apply_spec_augment": False,  # SpecAugment draws random masks in training mode
    # multi-head latent attention (DeepSeek-style): the rotary part is the head_dim
    "kv_lora_rank": 16, "q_lora_rank": 16, "qk_rope_head_dim": WIDTH // HEADS,
    "qk_nope_head_dim": WIDTH // HEADS, "qk_head_dim": 2 * WIDTH // HEADS,
    "v_head_dim": WIDTH // HEADS, "n_group": 2, "topk_group": 1,
    "index_head_dim": WIDTH // HEADS, "index_n_heads": 2, "encoder_hidden_size": WIDTH,
    "cross_hidden_size": WIDTH, "cross_num_attention_heads": HEADS,
    "cross_head_dim": WIDTH // HEADS, "cross_num_key_value_heads": 2,
}
# at most these (GroupNorm's group count must divide the narrower channels)
_CAPS = {"num_groups": 8}
_LISTS = {"depths": 1, "num_layers_per_block": 1, "hidden_sizes": None, "embed_dims": None}
_ZERO = ("dropout", "_pdrop", "dropout_prob", "dropout_rate", "layerdrop", "drop_path_rate",
         "mask_time_prob", "mask_feature_prob")


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ngdist.zoo_transformers import _transformers
    return _transformers()


def _shrink(cfg: Any) -> None:
    """Small values for the known size attributes of ``cfg`` and its sub-configs; dropout 0."""
    tf = _transformers()
    for key, value in list(vars(cfg).items()):
        if isinstance(value, tf.PretrainedConfig):
            _shrink(value)
        elif key in _SCALARS and (value is None or isinstance(value, (int, bool))):
            setattr(cfg, key, _SCALARS[key])
        elif key in _CAPS and isinstance(value, int):
            setattr(cfg, key, min(value, _CAPS[key]))
        elif "audio_token" in key and isinstance(value, int):
            setattr(cfg, key, AUDIO_TOKEN)  # inside the tiny vocabulary
        elif key in _LISTS and isinstance(value, (list, tuple)):
            n = len(value)
            setattr(cfg, key, [_LISTS[key]] * n if _LISTS[key] else
                    [32 * 2 ** i for i in range(n)])  # GroupNorm's 32 groups divide them
        elif any(key.endswith(z) for z in _ZERO) and isinstance(value, (float, list)):
            setattr(cfg, key, [0.0] * len(value) if isinstance(value, list) else 0.0)
    if getattr(cfg, "kv_lora_rank", None) and hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = cfg.num_attention_heads  # latent attention: no kv groups
    layers = getattr(cfg, "num_hidden_layers", 2)
    for key, value in list(vars(cfg).items()):  # layer_types, mlp_layer_types, ...
        if key.endswith("layer_types") and isinstance(value, list) and value:
            setattr(cfg, key, (value * layers)[:layers])


def hf_families(task: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    _transformers()
    return sorted(getattr(modeling_auto, TASKS[task]))


def _model(task: str, model_type: str) -> Any:
    tf = _transformers()
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    name = getattr(modeling_auto, TASKS[task])[model_type]
    cls = getattr(tf, name[0] if isinstance(name, tuple) else name)  # deit: (plain, teacher)
    cfg = CONFIG_MAPPING[model_type]()
    _shrink(cfg)
    cfg.num_labels = LABELS
    torch = _torch()
    torch.manual_seed(0)
    model = cls(cfg)
    with torch.no_grad():  # a zero router ties every expert: see the module's docstring
        for name, param in model.named_parameters():
            if ("router" in name or "gate" in name) and param.ndim > 1 and \
                    not param.any():
                param.normal_(0.0, 0.02)
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

        class Logits(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.model = model

            def forward(self, a, b=None, c=None, d=None, e=None):  # named: what people
                # write, and what both exporters take (dynamo matches *args to one input)
                inputs = [v for v in (a, b, c, d, e) if v is not None]
                if tokens:
                    *inputs, y = inputs
                logits = self.model(**dict(zip(names, inputs))).logits
                if not tokens:
                    return logits
                logits = logits[:, :-1] if shift else logits
                return torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), y, ignore_index=-100)

        return Logits().train()


def _audio_feeds(model: Any, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The main audio input: a waveform of 1600 samples, or a feature map the config's
    size (mel bins by 2 * max_source_positions frames, or frames by features)."""
    name = model.main_input_name
    cfg = model.config
    if name == "input_values":
        if hasattr(cfg, "max_length") and hasattr(cfg, "num_mel_bins"):  # AST
            shape: tuple[int, ...] = (BATCH, cfg.max_length, cfg.num_mel_bins)
        else:
            shape = (BATCH, 1600)
    elif hasattr(cfg, "max_source_positions") and hasattr(cfg, "num_mel_bins"):
        shape = (BATCH, cfg.num_mel_bins, 2 * cfg.max_source_positions)
    else:
        feat = getattr(cfg, "input_feat_per_channel", getattr(cfg, "feature_size", 16))
        shape = (BATCH, 32, feat * getattr(cfg, "input_channels", 1))
    return {name: rng.standard_normal(shape).astype(np.float32)}


def _is_audio_lm(model: Any) -> bool:
    """A decoder-only language model that reads audio through placeholder tokens (Granite
    Speech, AudioFlamingo3, ...): audio features in, no decoder_input_ids."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "input_features" in params and "decoder_input_ids" not in params \
        and hasattr(model, "get_audio_features")


def _audio_features(model: Any, rng: np.random.Generator
                    ) -> tuple[dict[str, np.ndarray], int]:
    """(the audio inputs, the audio embeddings per sample): a 32-frame feature map in the
    layout the audio encoder takes (features by frames or frames by features), and the
    frame mask where get_audio_features takes one."""
    import inspect

    torch = _torch()
    cfg = model.config
    sub = getattr(cfg, "audio_config", None) or getattr(cfg, "encoder_config", None) or cfg
    width = getattr(sub, "input_size", None) or getattr(sub, "input_dim", None) or \
        sub.num_mel_bins
    frames = 2 * getattr(sub, "max_source_positions", 16)
    params = inspect.signature(model.get_audio_features).parameters
    if "args" in params and hasattr(model, "model"):  # a delegate: its target's signature
        params = inspect.signature(model.model.get_audio_features).parameters
    masked = "input_features_mask" in params
    failures = []
    for shape in ((BATCH, width, frames), (BATCH, frames, width)):
        feeds = {"input_features": rng.standard_normal(shape).astype(np.float32)}
        if masked:
            feeds["input_features_mask"] = np.ones((BATCH, frames), np.int64)
        try:
            with torch.no_grad():
                out = model.get_audio_features(*map(torch.from_numpy, feeds.values()))
        except (RuntimeError, ValueError) as exc:
            failures.append(f"{shape}: {exc}")
            continue
        pooled = getattr(out, "pooler_output", out)
        return feeds, int(pooled.numel() // (BATCH * pooled.shape[-1]))
    raise ArgumentError(f"{type(model).__name__}: no audio feature layout runs: {failures}")


def _audio_lm(model: Any, rng: np.random.Generator) -> tuple[Any, dict[str, np.ndarray], Any]:
    """The audio embeddings' placeholders, then text (the last sequence right-padded); the
    loss over the next text token, audio positions and padding not counted (-100)."""
    audio, n = _audio_features(model, rng)
    ids, mask = _tokens(rng, VOCAB)
    ids[ids == AUDIO_TOKEN] = AUDIO_TOKEN - 1
    ids = np.concatenate([np.full((BATCH, n), AUDIO_TOKEN, np.int64), ids], 1)
    mask = np.concatenate([np.ones((BATCH, n), np.int64), mask], 1)
    labels = _labels(ids, mask)
    labels[:, :n] = -100
    feeds = {"input_ids": ids, "attention_mask": mask, **audio,
             "y": labels[:, 1:].reshape(-1)}
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


def _build(task: str, model_type: str) -> tuple[Any, dict[str, np.ndarray], Any]:
    torch = _torch()
    model = _model(task, model_type)
    rng = np.random.default_rng(0)
    if task in ("imgcls", "audiocls"):
        if task == "imgcls":
            side = getattr(model.config, "image_size", 32)
            side = side[0] if isinstance(side, (list, tuple)) else side
            chans = getattr(model.config, "num_channels", 3)
            feeds = {"pixel_values": rng.standard_normal((BATCH, chans, side, side))
                     .astype(np.float32)}
        else:
            feeds = _audio_feeds(model, rng)
        feeds["y"] = rng.integers(0, LABELS, BATCH).astype(np.int64)
        return _Logits.wrap(model, list(feeds)[:-1]), feeds, torch.nn.CrossEntropyLoss()
    if _is_audio_lm(model):
        return _audio_lm(model, rng)
    if _channels(model):
        return _multichannel_seq2seq(model, rng)
    vocab = _vocab(model) if task != "seqcls" else model.config.vocab_size
    ids, mask = _tokens(rng, min(vocab, VOCAB))
    if task == "causal":
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "y": _labels(ids, mask)[:, 1:].reshape(-1)}
        return _Logits.wrap(model, ["input_ids", "attention_mask"], True, True), feeds, None
    if task == "seqcls":
        feeds = {"input_ids": ids, "attention_mask": mask,
                 "y": rng.integers(0, LABELS, BATCH).astype(np.int64)}
        return _Logits.wrap(model, ["input_ids", "attention_mask"]), feeds, \
            torch.nn.CrossEntropyLoss()
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
