"""Fixes to the model sweep's tiny Hugging Face configs (``ngdist.zoo_sweep_configs``), one
per architecture whose default config, shrunk, does not build or is not tiny: what it lacks,
or derives from a size that was shrunk, or keeps under a name of its own (each with its
reason); ``tiny_config``: a default config shrunk, then fixed.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ngdist.zoo_sweep_configs import HEADS, LABELS, VOCAB, WIDTH, shrink, transformers


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


def _reformer(cfg: Any) -> None:
    """Reformer's axial position table factors 4096 positions into 64 x 64 with 64 + 192
    channels (the width is 32 here, and a training batch must hold all 4096 positions):
    ordinary position embeddings; local attention in both layers (LSH attention draws its
    hash rotations at random in each forward, which no export can replay); a decoder, which
    its LM head requires."""
    cfg.axial_pos_embds, cfg.attn_layers, cfg.is_decoder = False, ["local", "local"], True


def _roc_bert(cfg: Any) -> None:
    """RoCBert's pronunciation and glyph-shape embeddings (910 and 24858 rows of 768 and 512)
    the tiny vocabulary's rows of the tiny width."""
    cfg.pronunciation_vocab_size = cfg.shape_vocab_size = VOCAB
    cfg.pronunciation_embed_dim = cfg.shape_embed_dim = WIDTH


# Zamba's two kinds of layer: a Mamba layer, then two hybrid ones (the attention block they
# share, tied, then a Mamba layer each; one alone fails transformers' tying of the others
# to it); the defaults reach the first hybrid at layer 3 or 7
_HYBRID_LAYERS = ["linear_attention", "hybrid", "hybrid"]


def _zamba(cfg: Any) -> None:
    """Zamba derives its attention width, head size and Mamba dt rank from the hidden size
    when the config is made: derived again from the tiny one (7424 wide attention: 30 M
    parameters). Its layers are its layer-type list (76 long), not ``num_hidden_layers``."""
    cfg.attention_hidden_size, cfg.attention_head_dim = None, None
    cfg.mamba_dt_rank = "auto"
    cfg.layers_block_type = list(_HYBRID_LAYERS)
    cfg.__post_init__()


def _longcat_flash(cfg: Any) -> None:
    """LongCat-Flash names its widths ffn_hidden_size and expert_ffn_hidden_size (12288 and
    2048: 73 M parameters) and routes to 256 parameter-free zero experts besides: tiny widths,
    2 zero experts; its experts per token are ``moe_topk`` (12 of 4 + 2): 2."""
    cfg.ffn_hidden_size, cfg.expert_ffn_hidden_size, cfg.zero_expert_num = 2 * WIDTH, WIDTH, 2
    cfg.moe_topk = 2


def _timm_wrapper(cfg: Any) -> None:
    """The timm wrapper's default architecture is resnet50 (23 M parameters): timm's own
    small test ResNet."""
    cfg.architecture = "test_resnet"


def _textnet(cfg: Any) -> None:
    """TextNet's config asks for 640-pixel images (the sweep feeds ``image_size``): 64. Its
    first stage reads the stem's output, ``hidden_sizes[0]`` channels wide (the stem's default
    64), and its 4 stages of 3 to 4 convolutions each were 10.7 M parameters 512 wide: 32 to
    128 wide."""
    cfg.image_size = (64, 64)
    cfg.hidden_sizes = [32, 32, 64, 64, 128]
    cfg.stem_out_channels = cfg.hidden_sizes[0]


def _dots1(cfg: Any) -> None:
    """dots.llm1's mixture-of-experts layers always hold a shared expert
    ``n_shared_experts`` times as wide as a routed one, a count its default leaves None: 2, the
    released model's."""
    cfg.n_shared_experts = 2


def _dots3_note(cfg: Any) -> None:
    """dots3 note's text model alternates indexed (sparse-selected) and sliding-window latent
    attention: one layer of each (the shrunk depth kept only the first 2, both indexed), the
    sliding one's head as wide as its nope and rope parts (as transformers requires), a
    window of 4 and 4 indexed keys a query (8 tokens: both bind). Each layer type's rotary
    fraction, derived when the config is made, again the rope part of the tiny head (the
    default's 0.25 of 8 wide heads left a 2-wide table, broadcast over the rope part)."""
    text = getattr(cfg, "text_config", None) or cfg
    text.layer_types = ["indexed_attention", "sliding_attention"]
    text.per_layer_config = {1: {"head_dim": text.qk_nope_head_dim + text.qk_rope_head_dim}}
    text.sliding_window, text.index_topk = 4, 4
    for i, kind in enumerate(text.layer_types):
        text.rope_parameters[kind]["partial_rotary_factor"] = \
            text.qk_rope_head_dim / text.per_layer_config[i].head_dim


def _mistral4(cfg: Any) -> None:
    """Mistral 4's latent attention derives ``head_dim`` (its rotary table's width, times the
    rotary fraction) as the query head's, nope plus rope parts, when the config is made: derived
    again from the tiny parts (the shrunk 8 gave a rotary table half the rope part's width)."""
    cfg.head_dim = cfg.qk_head_dim = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim


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
    is made (``__post_init__``): derived again from the tiny one; its layers are its
    layer-type list (54 long)."""
    cfg.n_mamba_heads, cfg.intermediate_size = HEADS, None
    cfg.layers_block_type = list(_HYBRID_LAYERS)
    cfg.__post_init__()


def _xlstm(cfg: Any) -> None:
    """xLSTM's blocks are ``embedding_dim`` wide (its hidden size under another name) and
    ``num_blocks`` deep."""
    cfg.embedding_dim, cfg.num_blocks = cfg.hidden_size, cfg.num_hidden_layers


def _moonshine_streaming(cfg: Any) -> None:
    """The decoder reads ``num_key_value_heads`` from the top-level config, whose default
    lacks it (only the encoder's sub-config has one): as many as heads."""
    cfg.num_key_value_heads = cfg.num_attention_heads


def _dbrx(cfg: Any) -> None:
    """DBRX's attention reads ``attn_config.rope_theta`` and clamps its projections at
    ``clip_qkv``, which its default sub-config lacks (no attribute) and leaves None (a clamp
    with no bound raises): the rotary base the model uses and the released model's clip, 8;
    its experts' width (3584) the tiny one."""
    cfg.attn_config.rope_theta = cfg.rope_parameters["rope_theta"]
    cfg.attn_config.clip_qkv = 8.0
    cfg.ffn_config.ffn_hidden_size = 2 * WIDTH


def _gemma3n_text(cfg: Any) -> None:
    """Gemma 3n's last ``num_kv_shared_layers`` (15) layers reuse the keys and values of the
    last earlier layer of their type, and each layer has its own width and activation
    sparsity: 4 layers (sliding, full, sliding, full), the last 2 sharing, the first sparse
    as in the released model; per-layer inputs, LAuReL rank and sliding window tiny."""
    _gemma4(cfg)
    cfg.num_hidden_layers, cfg.num_kv_shared_layers = 4, 2
    cfg.layer_types = ["sliding_attention", "full_attention"] * 2
    cfg.intermediate_size = [2 * WIDTH] * 4
    cfg.activation_sparsity_pattern = [0.95, 0.0, 0.0, 0.0]
    cfg.laurel_rank, cfg.sliding_window = 8, 4


def _gemma3n(cfg: Any) -> None:
    """Gemma 3n's text model as ``_gemma3n_text`` makes it; its audio encoder's conformer
    (12 layers of 8 heads, named ``conf_*``) 2 layers of 4 heads, 32 mel features. Its
    vocabulary ends in the vision and audio encoders' hard tokens (128 each past 262144, at
    ``vocab_offset``): 16 each at the end of the tiny one, per-layer inputs for the text ids
    before them; as many audio placeholders an audio as the encoder gives (188 asked for 2).
    Its vision tower, timm's mobilenetv5_300m_enc (294 M parameters), unused by text and
    audio: timm's small test ResNet."""
    _gemma3n_text(cfg.text_config)
    audio = cfg.audio_config
    audio.conf_num_hidden_layers, audio.conf_num_attention_heads = 2, HEADS
    audio.input_feat_size, audio.sscp_conv_channel_size = 32, [16, 8]
    cfg.vision_config.vocab_offset, cfg.vision_config.vocab_size = VOCAB - 32, 16
    audio.vocab_offset, audio.vocab_size = VOCAB - 16, 16
    cfg.text_config.vocab_size_per_layer_input = VOCAB - 32
    cfg.audio_soft_tokens_per_image = 2  # the sweep's 32 frames: 4x subsampled, 4x reduced
    cfg.vision_config.architecture = "test_resnet"


def _kimi_linear(cfg: Any) -> None:
    """Kimi Linear names its experts per token ``num_experts_per_token`` (8 of the 4 tiny
    experts: top-k out of range) and its linear attention's heads ``linear_num_heads`` (32);
    one linear-attention layer, then one full (latent) attention layer."""
    cfg.num_experts_per_token, cfg.linear_num_heads = 2, HEADS
    cfg.layer_types = ["linear_attention", "full_attention"]


def _t5gemma(cfg: Any) -> None:
    """T5Gemma's cross-attention reads the encoder's output at
    ``decoder.cross_attention_hidden_size`` (2304): the tiny encoder's width."""
    cfg.decoder.cross_attention_hidden_size = cfg.encoder.hidden_size


def _layout_widths(cfg: Any) -> None:
    """LiLT and LayoutLMv3 embed a box as 6 equal parts of the hidden width (LiLT) or 4
    coordinates and 2 sizes (LayoutLMv3: 4 x coordinate_size + 2 x shape_size, 128 each):
    48 wide, 6 parts of 8 (LiLT's layout stream is a quarter as wide: 12)."""
    cfg.hidden_size, cfg.intermediate_size = 48, 96
    if hasattr(cfg, "coordinate_size"):
        cfg.coordinate_size = cfg.shape_size = 8


def _shieldgemma2(cfg: Any) -> None:
    """ShieldGemma 2 pools each image to ``mm_tokens_per_image`` (256) embeddings placed at
    its image token (262144) and scores its yes and no tokens (10784, 3771): 4 embeddings
    (8 x 8 patches pooled 4 x 4), the tokens inside the tiny vocabulary."""
    cfg.mm_tokens_per_image, cfg.image_token_index = 4, VOCAB - 2
    cfg.boi_token_index, cfg.eoi_token_index = VOCAB - 4, VOCAB - 3
    cfg.yes_token_index, cfg.no_token_index = 5, 6


def _nemo_speechlm(cfg: Any) -> None:
    """Nemotron transcribe's diarization head reads its encoder at
    ``head_config.audio_hidden_size`` (512): the tiny encoder's width. Its speech encoders'
    value projections are as wide as all heads (only the keys have kv groups): as many kv
    heads as heads, their default (2 met a padding mask's repeat of the values: 8 heads of
    4). Its Nemotron-H text model is 52 layers of 64 Mamba heads of 64 (17 M parameters): one
    Mamba, one mixture-of-experts and one attention layer, 4 Mamba heads as wide as the
    inner width allows, a 16-wide state."""
    diarization, text = cfg.audio_config.diarization_config, cfg.text_config
    diarization.head_config.audio_hidden_size = diarization.audio_config.hidden_size
    for sub in (cfg.audio_config.asr_config, diarization.audio_config,
                cfg.word_timestamp_config):
        sub.num_key_value_heads = sub.num_attention_heads
    text.layers_block_type = ["linear_attention", "moe", "full_attention"]
    text.mamba_num_heads, text.mamba_head_dim = HEADS, text.expand * text.hidden_size // HEADS
    text.n_groups, text.ssm_state_size = 2, 16
    text.moe_shared_expert_intermediate_size = 2 * WIDTH


def _lfm2_moe(cfg: Any) -> None:
    """LFM2-MoE's default config names no layer types (its layers index ``layer_types``;
    released configs list them): a convolution layer, then an attention one; the first
    dense, the second a mixture of experts."""
    cfg.layer_types, cfg.num_dense_layers = ["conv", "full_attention"], 1


def _vibevoice(cfg: Any) -> None:
    """VibeVoice's audio tokenizers double their width at each of 6 downsampling stages from
    ``num_filters`` (32: 2048 wide, 85 M parameters a tokenizer): 3 stages from 4 (32 wide),
    downsampling 4, 8 and 10 (a 1600-sample waveform: 5 audio embeddings)."""
    for sub in vars(cfg).values():
        if hasattr(sub, "downsampling_ratios") and hasattr(sub, "num_filters"):
            sub.num_filters, sub.downsampling_ratios, sub.depths = 4, [4, 8, 10], [1] * 4


FIXUPS: dict[str, Callable[[Any], None]] = {
    "blt": _blt,
    "dbrx": _dbrx,
    "dots1": _dots1,
    "dots3_note": _dots3_note,
    "dots3_note_text": _dots3_note,
    "efficientnet": _efficientnet,
    "esmc": _esmc,
    "gemma3n": _gemma3n,
    "gemma3n_text": _gemma3n_text,
    "gemma4": _gemma4,
    "gemma4_text": _gemma4,
    "hgnet_v2": _hgnet_v2,
    "kimi_linear": _kimi_linear,
    "kyutai_speech_to_text": _kyutai,
    "layoutlmv3": _layout_widths,
    "levit": _levit,
    "lfm2_moe": _lfm2_moe,
    "lilt": _layout_widths,
    "longcat_flash": _longcat_flash,
    "luke": _luke,
    "mamba2": _mamba2,
    "mistral4": _mistral4,
    "mobilevitv2": _mobilevitv2,
    "moonshine_streaming": _moonshine_streaming,
    "nemo_speechlm": _nemo_speechlm,
    "perceiver": _perceiver,
    "qwen3_asr": _qwen3_asr,
    "reformer": _reformer,
    "roc_bert": _roc_bert,
    "shieldgemma2": _shieldgemma2,
    "t5gemma": _t5gemma,
    "textnet": _textnet,
    "timm_wrapper": _timm_wrapper,
    "vibevoice": _vibevoice,
    "vibevoice_asr": _vibevoice,
    "xlstm": _xlstm,
    "zamba": _zamba,
    "zamba2": _zamba2,
}


def tiny_config(model_type: str) -> Any:
    """The default config of ``model_type``, shrunk, then fixed, with ``LABELS`` labels."""
    transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type]()
    shrink(cfg)
    if model_type in FIXUPS:
        FIXUPS[model_type](cfg)
    cfg.num_labels = LABELS
    return cfg
