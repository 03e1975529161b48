"""Tiny Hugging Face configs for the model sweep (``ngdist.zoo_sweep_hf``): a config is made
tiny by name: every attribute of a known width, depth, head count or vocabulary name present
in the config (or a sub-config) is set to a small value (latent attention's ranks and head
sizes too, with as many kv heads as heads; GroupNorm's group count capped at 8; audio
placeholder ids inside the tiny vocabulary).

Then the facts a config derives from the sizes are made consistent again (a Mamba-2 mixer's
heads times head size is its inner width; a rotary table per attention-layer type), and a few
architectures get what their own default config lacks or derives from a size that was
shrunk (``_FIXUPS``, each with its reason).
"""
from __future__ import annotations

import os
from collections.abc import Callable
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
    then the sizes a config derives made consistent again."""
    tf = transformers()
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


def _levit(cfg: Any) -> None:
    """LeViT's patch embedding is 4 stride-2 convolutions: its patch size is 16, fixed."""
    cfg.patch_size = 16


def _efficientnet(cfg: Any) -> None:
    """The last 1x1 convolution's width is ``round_filters(1280)`` of the width coefficient,
    and its BatchNorm's is ``hidden_dim``: they must agree (B0's coefficients: a small net)."""
    from transformers.models.efficientnet.modeling_efficientnet import round_filters

    cfg.width_coefficient, cfg.depth_coefficient = 0.5, 0.5
    cfg.hidden_dim = round_filters(cfg, 1280)


def _blt(cfg: Any) -> None:
    """BLT's local encoder and decoder read the global model's width as
    ``hidden_size_global`` (2048 by default) and the config derives the global model's input
    projection from the widths when it is made (``__post_init__``): derived again from the
    tiny ones; its hashed byte n-gram embeddings 97 rows each (500002: 16 M parameters a
    table)."""
    for sub in (cfg.encoder_config, cfg.decoder_config):
        sub.hidden_size_global = cfg.global_config.hidden_size
    cfg.encoder_hash_byte_group_vocab = VOCAB + 1
    cfg.__post_init__()


def _hgnet_v2(cfg: Any) -> None:
    """HGNetV2's stages are ``stage_*_channels`` wide (each stage's input the last one's
    output) and its head reads ``hidden_sizes[-1]``: shrunk together (the default's last
    stage is 2048 wide, the shrunk ``hidden_sizes`` 256: the head did not fit)."""
    cfg.stem_channels = (3, 16, 16)
    cfg.stage_in_channels, cfg.stage_mid_channels = (16, 32, 64, 128), (16, 16, 32, 32)
    cfg.stage_out_channels = (32, 64, 128, 256)
    cfg.hidden_sizes = list(cfg.stage_out_channels)
    cfg.stage_num_blocks, cfg.stage_numb_of_layers = (1, 1, 1, 1), (2, 2, 2, 2)


def _mobilevitv2(cfg: Any) -> None:
    """MobileViTV2 unfolds its 2x2 last-stage maps (64-pixel images) into patches of
    ``patch_size`` a side: its default 2, not the sweep's 8; half its default width."""
    cfg.patch_size, cfg.width_multiplier = 2, 0.5


def _perceiver(cfg: Any) -> None:
    """Perceiver's latents are ``d_latents`` wide (1280), ``num_latents`` (256) of them,
    through 26 self-attention layers: 16 of 32, 2 layers (the default held more than 8 GiB in
    training); 32-pixel images."""
    cfg.d_latents, cfg.num_latents, cfg.num_self_attends_per_block = WIDTH, 16, 2
    cfg.image_size = 32


def _esmc(cfg: Any) -> None:
    """ESM C normalises its keys over the whole hidden width: no kv groups (as many kv heads
    as heads; 2 gave a 16-wide key to a 32-wide LayerNorm)."""
    cfg.num_key_value_heads = cfg.num_attention_heads


def _luke(cfg: Any) -> None:
    """LUKE's entity embeddings: 500000 rows of 256 (128 M parameters), now the tiny
    vocabulary's rows of the tiny width."""
    cfg.entity_vocab_size, cfg.entity_emb_size = VOCAB, WIDTH


def _gemma4(cfg: Any) -> None:
    """Gemma 4's per-layer input embeddings: 262144 rows of 256 a layer (134 M parameters),
    now the tiny vocabulary's rows of 8."""
    for sub in (cfg, getattr(cfg, "text_config", None)):
        if sub is not None and hasattr(sub, "vocab_size_per_layer_input"):
            sub.vocab_size_per_layer_input, sub.hidden_size_per_layer_input = VOCAB, 8


def _roc_bert(cfg: Any) -> None:
    """RoCBert's pronunciation and glyph-shape embeddings (910 and 24858 rows of 768 and 512)
    the tiny vocabulary's rows of the tiny width."""
    cfg.pronunciation_vocab_size = cfg.shape_vocab_size = VOCAB
    cfg.pronunciation_embed_dim = cfg.shape_embed_dim = WIDTH


def _zamba(cfg: Any) -> None:
    """Zamba derives its attention width, head size and Mamba dt rank from the hidden size
    when the config is made: derived again from the tiny one (7424 wide attention: 30 M
    parameters)."""
    cfg.attention_hidden_size, cfg.attention_head_dim = None, None
    cfg.mamba_dt_rank = "auto"
    cfg.__post_init__()


def _longcat_flash(cfg: Any) -> None:
    """LongCat-Flash names its widths ffn_hidden_size and expert_ffn_hidden_size (12288 and
    2048: 73 M parameters) and routes to 256 parameter-free zero experts besides: tiny widths,
    2 zero experts."""
    cfg.ffn_hidden_size, cfg.expert_ffn_hidden_size, cfg.zero_expert_num = 2 * WIDTH, WIDTH, 2


def _timm_wrapper(cfg: Any) -> None:
    """The timm wrapper's default architecture is resnet50 (23 M parameters): timm's own
    small test ResNet."""
    cfg.architecture = "test_resnet"


def _textnet(cfg: Any) -> None:
    """TextNet's config asks for 640-pixel images (the sweep feeds ``image_size``): 64."""
    cfg.image_size = (64, 64)


def _kyutai(cfg: Any) -> None:
    """4 audio code streams of 16 codes (+1); the embedding's padding row is the one after
    the text vocabulary and every stream's codes, as transformers' default derives it."""
    cfg.num_codebooks, cfg.codebook_vocab_size = 4, 17
    cfg.audio_pad_token_id = cfg.vocab_size + cfg.num_codebooks * cfg.codebook_vocab_size
    cfg.audio_bos_token_id = cfg.codebook_vocab_size - 1
    cfg.codec_config.codebook_size, cfg.codec_config.num_quantizers = 16, 4
    cfg.codec_config.upsample_groups = cfg.codec_config.hidden_size  # depthwise, as default
    cfg.codec_config.num_filters = 4  # the codec (unused in training) held 22 M parameters


def _qwen3_asr(cfg: Any) -> None:
    """The audio encoder's output width is the text model's (the placeholders' embeddings)."""
    cfg.audio_config.output_dim = cfg.text_config.hidden_size
    cfg.audio_config.downsample_hidden_size = WIDTH  # its convolutions held 4 M parameters


def _mamba2(cfg: Any) -> None:
    """A Mamba-2 mixer's heads times head size is its inner width, expand x hidden (64: 4
    heads of 16), its heads split into ``n_groups`` (2) groups; a 16-wide state."""
    cfg.head_dim = cfg.expand * cfg.hidden_size // cfg.num_heads
    cfg.n_groups, cfg.state_size = 2, 16


def _zamba2(cfg: Any) -> None:
    """Zamba2 derives its attention and Mamba head sizes from the hidden size when the config
    is made (``__post_init__``): derived again from the tiny one."""
    cfg.n_mamba_heads, cfg.intermediate_size = HEADS, None
    cfg.__post_init__()


def _xlstm(cfg: Any) -> None:
    """xLSTM's blocks are ``embedding_dim`` wide (its hidden size under another name) and
    ``num_blocks`` deep."""
    cfg.embedding_dim, cfg.num_blocks = cfg.hidden_size, cfg.num_hidden_layers


def _moonshine_streaming(cfg: Any) -> None:
    """The decoder reads ``num_key_value_heads`` from the top-level config, whose default
    lacks it (only the encoder's sub-config has one): as many as heads."""
    cfg.num_key_value_heads = cfg.num_attention_heads


_FIXUPS: dict[str, Callable[[Any], None]] = {
    "blt": _blt,
    "efficientnet": _efficientnet,
    "esmc": _esmc,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "hgnet_v2": _hgnet_v2,
    "kyutai_speech_to_text": _kyutai,
    "levit": _levit,
    "longcat_flash": _longcat_flash,
    "luke": _luke,
    "mamba2": _mamba2,
    "mobilevitv2": _mobilevitv2,
    "moonshine_streaming": _moonshine_streaming,
    "perceiver": _perceiver,
    "qwen3_asr": _qwen3_asr,
    "roc_bert": _roc_bert,
    "textnet": _textnet,
    "timm_wrapper": _timm_wrapper,
    "xlstm": _xlstm,
    "zamba": _zamba,
    "zamba2": _zamba2,
}


def tiny_config(model_type: str) -> Any:
    """The default config of ``model_type``, shrunk, with ``LABELS`` labels."""
    transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    shrink(cfg)
    if model_type in _FIXUPS:
        _FIXUPS[model_type](cfg)
    cfg.num_labels = LABELS
    return cfg
