"""Kept tokens get their original RoPE positions; decode continues at M + offset."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import ROPE_CASES, build, random_tokens, tiny_model
from specprefill_engine.core import cleanup_rope, sparse_prefill
from specprefill_engine.core.positions import PositionedRoPE, position_runs

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
