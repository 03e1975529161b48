"""Tiny Hugging Face configs for the model sweep (``ngdist.zoo_sweep_hf``): a config is made
tiny by name: every attribute of a known width, depth, head count or vocabulary name present
in the config (or a sub-config) is set to a small value (latent attention's ranks and head
sizes too, with as many kv heads as heads; GroupNorm's group count capped at 8; audio
placeholder ids inside the tiny vocabulary).

Then the facts a config derives from the sizes are made consistent again (a Mamba-2 mixer's
heads times head size is its inner width; a rotary table per attention-layer type), and a few
architectures get what their own default config lacks or derives from a size that was
shrunk (``ngdist.zoo_sweep_fixups``, whose ``tiny_config`` does both).
"""
from __future__ import annotations

import os
from typing import Any

VOCAB, LENGTH, BATCH, LABELS, PAD = 96, 8, 3, 3, 0
AUDIO_TOKEN = VOCAB - 1  # an audio language model's placeholder, never drawn as text
WIDTH, HEADS = 32, 4
_SCALARS = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "d_embed",
                     "embedding_size", "hidden_dim", "word_embed_proj_dim",
                     "emb_dim"), WIDTH),  # emb_dim: XLM's and Flaubert's hidden_size
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                     "encoder_layers", "decoder_layers", "num_decoder_layers",
                     "num_encoder_layers", "decoder_num_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads", "decoder_num_attention_heads"),
                    HEADS),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim",
                     "d_ff", "n_inner", "decoder_intermediate_size", "mlp_dim"), 2 * WIDTH),
    **dict.fromkeys(("vocab_size", "src_vocab_size", "tgt_vocab_size"), VOCAB),
    # seamless_m4t's speech encoder
    "speech_encoder_layers": 2, "speech_encoder_intermediate_size": 2 * WIDTH,
    "speech_encoder_attention_heads": HEADS, "pooler_hidden_size": WIDTH,
    "rotary_dim": WIDTH // HEADS // 2, "mamba_d_ssm": 2 * WIDTH,
    "head_dim": WIDTH // HEADS, "d_kv": WIDTH // HEADS,
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
# per stage: depths 1; head counts HEADS (they divide every stage's width, 32 * 2**i)
_LISTS = {"depths": 1, "num_layers_per_block": 1, "hidden_sizes": None, "embed_dims": None,
          "embed_dim": None, "num_heads": HEADS, "num_attention_heads": HEADS}
_ZERO = ("dropout", "_pdrop", "dropout_prob", "dropout_rate", "layerdrop", "drop_path_rate",
         "mask_time_prob", "mask_feature_prob", "jitter_noise")  # (a router's random jitter)


def transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from ngdist.zoo_transformers import _transformers
    return _transformers()


def shrink(cfg: Any) -> None:
    """Small values for the known size attributes of ``cfg`` and its sub-configs; dropout 0;
    then the sizes a config derives made consistent again. A heterogeneous config's per-layer
    overrides (``per_layer_config``) are shrunk alike, those of layers past the new depth
    dropped (transformers refuses a global read of a per-layer attribute)."""
    tf = transformers()
    spec = vars(cfg).get("_heterogeneity_spec")
    if spec is not None:
        cfg.per_layer_config = None
    for key, value in list(vars(cfg).items()):
        if isinstance(value, tf.PretrainedConfig):
            shrink(value)
        elif key in _SCALARS and (value is None or isinstance(value, (int, bool))):
            setattr(cfg, key, _SCALARS[key])
        elif key in _CAPS and isinstance(value, int):
            setattr(cfg, key, min(value, _CAPS[key]))
        elif "audio_token" in key and (isinstance(value, int) or (
                value is None and key.endswith(("_id", "_index")))):
            setattr(cfg, key, AUDIO_TOKEN)  # inside the tiny vocabulary (Voxtral: none set)
        elif key in _LISTS and isinstance(value, (list, tuple)):
            n = len(value)
            setattr(cfg, key, [_LISTS[key]] * n if _LISTS[key] else
                    [32 * 2 ** i for i in range(n)])  # GroupNorm's 32 groups divide them
        elif any(key.endswith(z) for z in _ZERO) and isinstance(value, (float, list)):
            setattr(cfg, key, [0.0] * len(value) if isinstance(value, list) else 0.0)
    _derived(cfg)
    if spec is not None:
        cfg.per_layer_config = {i: _tiny_layer(o) for i, o in spec.per_layer_overrides.items()
                                if i < cfg.num_hidden_layers}


def _tiny_layer(overrides: dict[str, Any]) -> dict[str, Any]:
    """One layer's overrides of a heterogeneous config, shrunk as ``shrink`` shrinks the
    config's own (latent attention with as many kv heads as heads)."""
    tiny = {key: _SCALARS[key] if key in _SCALARS and isinstance(value, int) else value
            for key, value in overrides.items()}
    if tiny.get("kv_lora_rank") and "num_attention_heads" in tiny:
        tiny["num_key_value_heads"] = tiny["num_attention_heads"]
    return tiny


def _derived(cfg: Any) -> None:
    """What a config derives from sizes ``shrink`` changed: latent attention has no kv groups;
    a layer-type list as long as the layers; a Mamba-2 mixer's heads times head size equal to
    its inner width (expand x hidden); a rotary table for each attention-layer type where the
    config names none."""
    if getattr(cfg, "kv_lora_rank", None) and hasattr(cfg, "num_key_value_heads"):
        cfg.num_key_value_heads = cfg.num_attention_heads  # latent attention: no kv groups
    layers = getattr(cfg, "num_hidden_layers", 2)
    for key, value in list(vars(cfg).items()):  # layer_types, mlp_layer_types, ...
        if key.endswith("layer_types") and isinstance(value, list) and value:
            setattr(cfg, key, (value * layers)[:layers])
    inner = getattr(cfg, "mamba_d_ssm", None) or \
        getattr(cfg, "mamba_expand", 0) * getattr(cfg, "hidden_size", 0)
    if inner and isinstance(getattr(cfg, "mamba_d_head", None), int) and \
            cfg.mamba_d_head * cfg.mamba_n_heads != inner:
        cfg.mamba_n_heads, cfg.mamba_d_head = HEADS, inner // HEADS
        cfg.mamba_d_state = min(getattr(cfg, "mamba_d_state", 16), 16)
    if getattr(cfg, "is_encoder_decoder", False) and \
            getattr(cfg, "decoder_start_token_id", None) is None:
        cfg.decoder_start_token_id = PAD  # T5's: the decoder starts at the pad token
    if isinstance(getattr(cfg, "window_size", None), int) and \
            isinstance(getattr(cfg, "depths", None), list) and \
            isinstance(getattr(cfg, "embed_dim", None), int):
        _windowed_stages(cfg)
    if isinstance(getattr(cfg, "layer_types", None), list) and \
            getattr(cfg, "rope_parameters", None) == {}:
        cfg.rope_parameters = {t: {"rope_type": "default", "rope_theta": 10000.0}
                               for t in set(cfg.layer_types) if "attention" in t}


def _windowed_stages(cfg: Any) -> None:
    """A Swin-like hierarchy: windows of 2 patches a side on 4-pixel patches (64-pixel images:
    16, 8, 4 and 2 patches a side in 4 stages; a window larger than its stage fails in
    transformers), the stage count and last width as ``depths`` and ``embed_dim`` say."""
    cfg.window_size, cfg.patch_size = 2, 4
    stages = len(cfg.depths)
    if hasattr(cfg, "num_layers"):
        cfg.num_layers = stages
    if hasattr(cfg, "hidden_size"):
        cfg.hidden_size = cfg.embed_dim * 2 ** (stages - 1)
