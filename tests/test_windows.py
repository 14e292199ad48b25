"""Sliding-window layers see the kept keys inside their window by TRUE position, as dense
attention with the dropped tokens masked out would: in a chunked sparse prefill, after
a cached prefix (dense or sparse), and in decode after it."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from models import HYBRID_CASES, ROPE_CASES, build, kept_chunks, random_tokens, wrappers_left
from specprefill_engine.core import cleanup_rope, sparse_prefill
from specprefill_engine.core.sparse_prefill import cover_sliding_window

M, PREFIX, WINDOW = 300, 100, 64
GPT_OSS = ROPE_CASES["gpt_oss"][1]
CASES = {
    # sliding, global, sliding, global: the second sliding layer's input went through both
    "gemma3": ("gemma3_text", {**HYBRID_CASES["gemma3-small-window"][1], "num_hidden_layers": 4,
                               "sliding_window": WINDOW}),
    "gpt_oss": ("gpt_oss", {**GPT_OSS, "num_hidden_layers": 4, "sliding_window": WINDOW,
                            "layer_types": GPT_OSS["layer_types"] * 2}),
}


class Recorder(nn.Module):
    """Passes a projection's calls through, keeping each call's input."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.inputs = []

    def __call__(self, x):
        self.inputs.append(x)
        return self.inner(x)


class TruePositions(nn.Module):
    """Rotates token i at positions[i], one call of the model's own rope per token."""

    def __init__(self, inner, positions):
        super().__init__()
        self.inner = inner
        self.positions = [int(p) for p in positions]

    def __call__(self, x, offset=0):
        assert x.shape[-2] == len(self.positions)
        return mx.concatenate([self.inner(x[..., i : i + 1, :], offset=p)
                               for i, p in enumerate(self.positions)], axis=-2)


def model_with_recorders(case):
    model = build(CASES[case])
    for layer in model.layers:
        attention = layer.self_attn
        if hasattr(attention, "sinks"):  # gpt_oss: non-zero sinks, so they take part
            attention.sinks = mx.random.normal(attention.sinks.shape, key=mx.random.key(3))
        attention.q_proj = Recorder(attention.q_proj)  # its input: the attention's input
        attention.o_proj = Recorder(attention.o_proj)  # its input: the attention's output
    return model


def check_attention_by_position(model, positions: np.ndarray):
    """Every layer's recorded attention output (all calls, in order) equals the layer's own
    attention over all fed entries at `positions`, masked by position: causal, and
    q - window < k for layers with a rotating cache."""
    caches = make_prompt_cache(model)
    n_sliding = 0
    for layer, layer_cache in zip(model.layers, caches):
        attention = layer.self_attn
        q_proj, o_proj = attention.q_proj, attention.o_proj
        inputs = mx.concatenate(q_proj.inputs, axis=1)
        outputs = mx.concatenate(o_proj.inputs, axis=1)
        assert inputs.shape[1] == positions.size
        q = positions[:, None]
        mask = positions[None] <= q
        if isinstance(layer_cache, RotatingKVCache):
            mask &= positions[None] > q - layer_cache.max_size
            n_sliding += 1
        rope = attention.rope
        attention.rope = TruePositions(rope, positions)
        attention.q_proj, attention.o_proj = q_proj.inner, Recorder(o_proj.inner)
        try:
            attention(inputs, mx.array(mask), None)
            expected = attention.o_proj.inputs[0]
        finally:
            attention.rope, attention.q_proj, attention.o_proj = rope, q_proj, o_proj
        assert mx.abs(outputs - expected).max().item() <= 1e-4
    assert n_sliding == 2


def decode(model, cache, steps=2):
    for token in range(5, 5 + steps):
        model(mx.array([[token]]), cache=cache)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("prefix, step_size", [(0, 50), (PREFIX, 50), (0, 1)])
def test_sliding_layers_see_kept_keys_inside_the_window(case, prefix, step_size):
    """Chunks of 50 kept tokens (concatenating cache updates), single-token chunks
    (in-place, rotating updates), with and without a dense prefix; then two decode steps."""
    model = model_with_recorders(case)
    tokens = random_tokens(prefix + M)
    cache = make_prompt_cache(model)
    if prefix:
        model(tokens[None, :prefix], cache=cache)
    kept = cover_sliding_window(kept_chunks(M), cache, M, prefix)
    sparse_prefill(model, tokens[prefix:], kept, cache, step_size=step_size,
                   position_offset=prefix)
    decode(model, cache)
    cleanup_rope(model)
    positions = np.concatenate([np.arange(prefix), prefix + kept, prefix + M + np.arange(2)])
    check_attention_by_position(model, positions)
    assert not wrappers_left(model)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_stored_sparse_prefix_continues_by_position(case):
    """A sparse prefix's entries (with gaps) are seen at their positions by the next part."""
    model = model_with_recorders(case)
    tokens = random_tokens(PREFIX + M)
    cache = make_prompt_cache(model)
    first = cover_sliding_window(kept_chunks(PREFIX + 60, every=2), cache, PREFIX + 60)
    sparse_prefill(model, tokens[: PREFIX + 60], first, cache, step_size=40)
    cleanup_rope(model)
    second = cover_sliding_window(kept_chunks(M - 60), cache, M - 60, PREFIX + 60)
    with pytest.raises(ValueError, match="cached_positions"):
        sparse_prefill(model, tokens[PREFIX + 60 :], second, cache, position_offset=PREFIX + 60)
    sparse_prefill(model, tokens[PREFIX + 60 :], second, cache, step_size=50,
                   position_offset=PREFIX + 60, cached_positions=first)
    decode(model, cache)
    cleanup_rope(model)
    positions = np.concatenate([first, PREFIX + 60 + second, PREFIX + M + np.arange(2)])
    check_attention_by_position(model, positions)
    assert not any("make_mask" in vars(c) for c in cache)
