"""Tiny random-weight models built from mlx-lm's own ModelArgs, for tests."""

import importlib

import mlx.core as mx
import mlx.nn as nn

BASE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    rms_norm_eps=1e-6,
    vocab_size=128,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
    head_dim=16,
    rope_theta=10000.0,
)


def tiny_model(model_type: str, seed: int = 0, **overrides) -> nn.Module:
    """A float32 mlx-lm model of `model_type` with random weights."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    config = {"model_type": model_type, **BASE, **overrides}
    args = module.ModelArgs.from_dict(config)
    mx.random.seed(seed)
    model = module.Model(args)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


def random_tokens(length: int, vocab: int = 128, seed: int = 0) -> mx.array:
    mx.random.seed(seed)
    return mx.random.randint(5, vocab, (length,))
