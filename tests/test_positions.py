"""Kept tokens get their original RoPE positions; decode continues at M + offset."""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import ROPE_CASES, build, random_tokens, tiny_model
from specprefill_engine.core import cleanup_rope, positioned_rope, sparse_prefill
from specprefill_engine.core.adapters import rope_owners
from specprefill_engine.core.positions import PositionedRoPE, position_runs, rope_fallbacks

M = 300


def kept_indices(length: int, seed: int = 1) -> mx.array:
    """Random whole 32-token chunks, the first chunk and the last token included."""
    rng = np.random.default_rng(seed)
    n_chunks = -(-length // 32)
    chunks = {0, n_chunks - 1} | set(rng.choice(n_chunks, n_chunks // 3, replace=False).tolist())
    kept = [i for c in sorted(chunks) for i in range(c * 32, min((c + 1) * 32, length))]
    return mx.array(kept)


def first_layer_keys(cache, length: int) -> mx.array:
    """Layer 0's cached keys and values side by side (MLA keeps its rotated part in
    the values slot), for the first `length` positions."""
    return mx.concatenate(
        [cache[0].keys[..., :length, :], cache[0].values[..., :length, :]], axis=-1)


def wrappers_left(model) -> int:
    return sum(isinstance(m, PositionedRoPE) for _, m in model.named_modules())


def check_exact(model, prefix: int):
    tokens = random_tokens(prefix + M)
    prompt = tokens[prefix:]
    kept = kept_indices(M)
    dense, sparse = make_prompt_cache(model), make_prompt_cache(model)
    if prefix:
        for cache in (dense, sparse):
            model(tokens[:prefix][None], cache=cache)
    step = mx.array([[7]])
    model(tokens[None, prefix:], cache=dense)
    model(step, cache=dense)
    sparse_prefill(model, prompt, kept, sparse, step_size=50, position_offset=prefix)

    dense_keys = first_layer_keys(dense, prefix + M)
    sparse_keys = first_layer_keys(sparse, prefix + kept.size)
    expected = dense_keys[..., prefix + kept, :]
    assert mx.abs(sparse_keys[..., prefix:, :] - expected).max().item() <= 1e-4
    if prefix:
        assert mx.array_equal(sparse_keys[..., :prefix, :], dense_keys[..., :prefix, :])

    model(step, cache=sparse)  # plain decode call on the shifted model
    new_dense = first_layer_keys(dense, prefix + M + 1)[..., -1, :]
    new_sparse = first_layer_keys(sparse, prefix + kept.size + 1)[..., -1, :]
    assert mx.abs(new_dense - new_sparse).max().item() <= 1e-4
    cleanup_rope(model)
    assert wrappers_left(model) == 0


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
@pytest.mark.parametrize("prefix", [0, 100])
def test_kept_keys_and_decode_key_match_dense(case, prefix):
    check_exact(build(ROPE_CASES[case]), prefix)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_exact_through_quantized_projections(case, bits):
    check_exact(build(ROPE_CASES[case], bits=bits), prefix=100)


def test_a_wrong_offset_is_caught():
    """The check above is sensitive: a dense run of positions fails it."""
    model = tiny_model("llama")
    tokens = random_tokens(M)
    kept = kept_indices(M)
    dense, sparse = make_prompt_cache(model), make_prompt_cache(model)
    model(tokens[None], cache=dense)
    model(tokens[kept][None], cache=sparse)  # kept tokens at positions 0..N-1
    error = mx.abs(dense[0].keys[..., kept, :] - sparse[0].keys[..., : kept.size, :]).max()
    assert error.item() > 1e-2


def test_position_runs():
    assert position_runs(np.array([0, 1, 2, 10, 11, 40])) == [(0, 3), (10, 2), (40, 1)]
    assert position_runs(np.array([], dtype=np.int64)) == []


def test_invalid_selections_raise_and_leave_model_clean():
    model = tiny_model("llama")
    tokens = random_tokens(64)
    for bad in ([0, 1, 2], [5, 3, 63], [0, 64], []):
        with pytest.raises(ValueError):
            sparse_prefill(model, tokens, bad, make_prompt_cache(model))
        assert wrappers_left(model) == 0


def test_exception_mid_prefill_leaves_model_unwrapped():
    model = tiny_model("qwen3")
    tokens = random_tokens(M)
    calls = []

    def cancel_after_two():
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError):
        sparse_prefill(model, tokens, mx.arange(M), make_prompt_cache(model), step_size=32,
                       cancel_check=cancel_after_two)
    assert wrappers_left(model) == 0


# one RoPE call per layer (per-token positions) and the per-run fallback ---------------

def count_rope_calls(monkeypatch) -> list:
    calls = []
    real = mx.fast.rope

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(mx.fast, "rope", counting)
    return calls


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_one_rope_call_per_layer_for_every_variant(case, monkeypatch):
    """Queries and keys of a chunk with many runs: two calls per layer, no fallback."""
    model = build(ROPE_CASES[case])
    kept = kept_indices(M)
    assert len(position_runs(np.array(kept))) > 3
    calls = count_rope_calls(monkeypatch)
    sparse_prefill(model, random_tokens(M), kept, make_prompt_cache(model), step_size=M)
    cleanup_rope(model)
    assert len(calls) == 2 * len(rope_owners(model))
    assert rope_fallbacks(model) == []


class NoArrayOffsetRoPE(nn.Module):
    """A custom RoPE whose offset must be a Python int (it builds its own tables)."""

    def __init__(self, dims: int, base: float = 10000.0):
        super().__init__()
        self.dims, self.base = dims, base

    def __call__(self, x, offset=0):
        offset = int(offset)  # fails for an array of positions
        positions = mx.arange(offset, offset + x.shape[-2], dtype=mx.float32)
        inv = self.base ** (-mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)
        angles = positions[:, None] * inv[None]
        cos, sin = mx.cos(angles), mx.sin(angles)
        x1, x2 = x[..., : self.dims // 2], x[..., self.dims // 2 : self.dims]
        return mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos, x[..., self.dims:]], -1)


def test_a_rope_without_array_offsets_falls_back_per_run_and_says_so(caplog):
    model = tiny_model("llama")
    for layer in model.layers:
        layer.self_attn.rope = NoArrayOffsetRoPE(16)
    with caplog.at_level("WARNING", logger="specprefill_engine.core.positions"):
        check_exact(model, prefix=100)
    reasons = rope_fallbacks(model)
    assert len(reasons) == 1 and "NoArrayOffsetRoPE" in reasons[0]
    assert "one run at a time" in caplog.text


def test_dynamic_ntk_beyond_its_window_falls_back_per_run_and_says_so():
    """Past max_position_embeddings dynamic NTK's base depends on the length of the call
    (dense prefill itself then depends on its chunking): kept runs are rotated as before,
    one call each, and the fallback is reported."""
    model = tiny_model("llama", rope_scaling={"type": "dynamic", "factor": 2.0},
                       max_position_embeddings=256)
    recorder = RunRecorder(model.layers[0].self_attn.rope)
    model.layers[0].self_attn.rope = recorder
    kept = kept_indices(M)
    sparse_prefill(model, random_tokens(M), kept, make_prompt_cache(model), step_size=M)
    cleanup_rope(model)
    assert recorder.calls[: len(recorder.calls) // 2] == position_runs(np.array(kept))
    assert any("dynamic NTK beyond" in r for r in rope_fallbacks(model))


class RunRecorder(nn.Module):
    """Passes calls through to a DynamicNTK rope, writing down (offset, length)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = []

    def __call__(self, x, offset=0):
        self.calls.append((int(offset), x.shape[-2]))
        return self.inner(x, offset=offset)


def test_a_moved_decode_step_puts_the_models_own_wrappers_back_and_decodes_at_its_positions():
    """A moved decode step wraps every layer's rope and unwraps it after; the wrappers are
    made once per model and put back each step (building them was most of a moved step's
    extra host time), and the step's keys are those of positions M + t."""
    model = build(ROPE_CASES["llama"])
    tokens = random_tokens(40, seed=2)
    dense = make_prompt_cache(model)
    model(tokens[None], cache=dense)
    model(mx.array([[5, 6]]), cache=dense)
    moved = make_prompt_cache(model)
    model(tokens[None, :30], cache=moved)  # 30 entries standing for a prompt of 40
    seen = []
    for token in (5, 6):
        with positioned_rope(model, shift=10):
            seen.append([owner["rope"] for owner in rope_owners(model)])
            model(mx.array([[token]]), cache=moved)
        assert wrappers_left(model) == 0
    assert all(isinstance(rope, PositionedRoPE) for rope in seen[0])
    assert all(a is b for a, b in zip(*seen))  # the same objects, not new ones each step
    got = moved[0].keys[..., 30:32, :]
    assert mx.abs(got - dense[0].keys[..., 40:42, :]).max().item() <= 1e-4
