"""Small Hugging Face transformers built from configs (random init, nothing downloaded), each
wrapped so that its output is its training loss, for ``ngdist.compile(..., loss=None)``.

Models (by default 2 layers, hidden 32, 4 attention heads; vocabulary 64, at most 64
positions, ``attn_implementation`` the default ``"sdpa"``, dropout off so that a step is a
deterministic function):

* ``bert``: ``BertForSequenceClassification`` (3 classes, labels per sequence);
* ``gpt2``: ``GPT2LMHeadModel`` (labels per token, tied LM head);
* ``t5``: ``T5ForConditionalGeneration`` (encoder-decoder, the decoder fed the shifted labels,
  a trained relative position bias as the attention's float mask);
* ``llama``: ``LlamaForCausalLM`` with 2 key/value heads for 4 query heads (grouped-query
  attention, ``enable_gqa=True`` with ``is_causal``);
* ``llama_padded``: the same with an ``attention_mask`` whose first sample is left-padded by 3
  tokens (labels -100 there): a boolean attention mask, key/value heads repeated by the model.

Needs ``pip install 'ngdist[zoo]'`` (transformers, with the ``torch`` extra). ``HF_HUB_OFFLINE``
is set to 1 when unset.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any

import numpy as np

VOCAB = 64
MODELS = ("bert", "gpt2", "t5", "llama", "llama_padded")


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # every model comes from a config
    if importlib.util.find_spec("torchvision") is not None:
        # transformers imports torchvision when it is installed; the vision extra's wheel
        # beside the CPU torch needs the import of ngdist.zoo_vision (its docstring says why)
        from ngdist.zoo_vision import import_torchvision
        import_torchvision()
    try:
        import transformers
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise ImportError("the transformers zoo needs transformers and torch: "
                          "pip install 'ngdist[zoo,torch]'") from exc
    return transformers


def _config(name: str, width: int = 32, layers: int = 2) -> Any:
    tf = _transformers()
    if width % 4:
        raise ValueError(f"width must be a multiple of the 4 attention heads; got {width}")
    if name == "bert":
        return tf.BertForSequenceClassification, tf.BertConfig(
            vocab_size=VOCAB, hidden_size=width, num_hidden_layers=layers,
            num_attention_heads=4, intermediate_size=2 * width, max_position_embeddings=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3)
    if name == "gpt2":
        return tf.GPT2LMHeadModel, tf.GPT2Config(
            vocab_size=VOCAB, n_embd=width, n_layer=layers, n_head=4, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    if name == "t5":
        return tf.T5ForConditionalGeneration, tf.T5Config(
            vocab_size=VOCAB, d_model=width, d_kv=width // 4, d_ff=2 * width,
            num_layers=layers, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1)
    if name in ("llama", "llama_padded"):
        return tf.LlamaForCausalLM, tf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=64, bos_token_id=0, eos_token_id=1)
    raise ValueError(f"unknown transformers zoo model {name!r}; valid: {', '.join(MODELS)}")


def build(name: str, seed: int = 0, width: int = 32, layers: int = 2) -> Any:
    """The model ``name`` (one of :data:`MODELS`; hidden size ``width``, feed-forward
    ``2 * width``, ``layers`` layers), initialized under ``torch.manual_seed(seed)`` and
    wrapped: ``module(input_ids, labels[, attention_mask])`` is the loss."""
    import torch

    cls, cfg = _config(name, width, layers)

    class LossOf(torch.nn.Module):
        """``model(input_ids=..., labels=..., attention_mask=...).loss``."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, labels, attention_mask=None):
            return self.model(input_ids=input_ids, labels=labels,
                              attention_mask=attention_mask).loss

    torch.manual_seed(seed)
    return LossOf(cls(cfg))


def batch(name: str, size: int = 3, length: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Random token ids (2..63) and labels for ``name``, in the wrapped forward's order."""
    _config(name)  # refuses an unknown name
    rng = np.random.default_rng(seed)
    out = {"input_ids": rng.integers(2, VOCAB, (size, length)).astype(np.int64)}
    if name == "bert":
        out["labels"] = rng.integers(0, 3, size).astype(np.int64)
    else:
        out["labels"] = rng.integers(2, VOCAB, (size, length)).astype(np.int64)
    if name == "llama_padded":  # the first sample left-padded by 3 tokens, not predicted there
        mask = np.ones((size, length), np.int64)
        mask[0, :3] = 0
        out["labels"][0, :3] = -100
        out["attention_mask"] = mask
    return out


def tensors(feeds: dict[str, np.ndarray]) -> tuple[Any, ...]:
    """The feeds as torch tensors, in order: the wrapped module's positional arguments."""
    import torch

    return tuple(torch.from_numpy(v) for v in feeds.values())
