"""SpecPrefill across the families mlx-lm users serve: hybrids, sliding windows, MoE,
quantized weights, and clear errors for what the core cannot handle."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import (
    HYBRID_CASES, MAMBA, ROPE_CASES, build, kept_chunks, random_tokens, save_with_demo_tokenizer,
)
from specprefill_engine import Engine, ModelLoadError
from specprefill_engine.core import (
    UnsupportedModelError, cleanup_rope, score_tokens, select_chunks, sparse_prefill,
)
from specprefill_engine.core.adapters import rope_owners
from specprefill_engine.core.positions import PositionedRoPE
from specprefill_engine.loading import DEMO_DRAFT

M, PREFIX = 300, 100
ALL_CASES = {**ROPE_CASES, **HYBRID_CASES}


def no_wrappers(model):
    return not any(isinstance(m, PositionedRoPE) for _, m in model.named_modules())


class RecordingRoPE(nn.Module):
    """Wraps a model's real rope and writes down the positions it rotates."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.calls = []

    def __call__(self, x, offset=0):
        if isinstance(offset, mx.array) and offset.size > 1:  # one position per sequence
            assert x.shape[-2] == 1 and x.shape[0] == offset.size
            self.calls += [(p, 1) for p in offset.tolist()]
        else:
            self.calls.append((int(offset), x.shape[-2]))
        return self.inner(x, offset=offset)


# nemotron_h has no RoPE; gemma3-small-window adds its window (tested on its own below)
@pytest.mark.parametrize("case", sorted(set(ALL_CASES) - {"nemotron_h", "gemma3-small-window"}))
def test_every_attention_layer_rotates_kept_tokens_at_original_positions(case):
    """Exact for hybrids whose first layer is linear too: what each attention layer's
    RoPE is asked to rotate is every kept token at prefix + its index, then M."""
    model = build(ALL_CASES[case])
    tokens = random_tokens(PREFIX + M)
    cache = make_prompt_cache(model)
    model(tokens[None, :PREFIX], cache=cache)
    recorders = []
    for owner in rope_owners(model):
        owner.rope = RecordingRoPE(owner.rope)
        recorders.append(owner.rope)
    assert recorders
    kept = kept_chunks(M)
    # a first pass lets positions.py probe the (unknown) recording class once
    sparse_prefill(model, tokens[PREFIX:], kept, make_prompt_cache(model), step_size=64)
    cleanup_rope(model)
    for recorder in recorders:
        recorder.calls.clear()
    sparse_prefill(model, tokens[PREFIX:], kept, cache, step_size=64, position_offset=PREFIX)
    expected = (np.array(kept) + PREFIX).tolist()
    for recorder in recorders:
        rotated = [p for offset, n in recorder.calls for p in range(offset, offset + n)]
        # queries and keys: each kept position rotated exactly twice
        assert sorted(set(rotated)) == expected and len(rotated) == 2 * len(expected)
        recorder.calls.clear()
    model(mx.array([[5]]), cache=cache)
    for recorder in recorders:
        assert {offset for offset, _ in recorder.calls} == {PREFIX + M}
    cleanup_rope(model)
    assert no_wrappers(model)


def greedy(model, cache, logits, n=6):
    tokens = [mx.argmax(logits[0]).item()]
    while len(tokens) < n:
        tokens.append(mx.argmax(model(mx.array([[tokens[-1]]]), cache=cache)[0, -1]).item())
    return tokens


QUANTIZABLE = sorted(set(ALL_CASES) - {"deepseek_v3-mla"})  # its 16-wide latent < group 32


@pytest.mark.parametrize(
    "case, bits", [(c, 0) for c in sorted(ALL_CASES)] + [(c, 4) for c in QUANTIZABLE])
def test_keep_all_gives_dense_greedy_tokens(case, bits):
    model = build(ALL_CASES[case], bits=bits)
    tokens = random_tokens(M)
    dense_cache = make_prompt_cache(model)
    dense = greedy(model, dense_cache, model(tokens[None], cache=dense_cache)[:, -1])
    cache = make_prompt_cache(model)
    try:
        sparse = greedy(model, cache, sparse_prefill(model, tokens, mx.arange(M), cache, step_size=M))
    finally:
        cleanup_rope(model)
    assert sparse == dense
    assert no_wrappers(model)


@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_scoring_gives_finite_scores_or_a_clear_reason(case):
    model = build(ALL_CASES[case], bits=4 if case == "llama" else 0)
    tokens = random_tokens(M)
    if case == "deepseek_v3-mla":
        with pytest.raises(UnsupportedModelError, match="MLA"):
            score_tokens(model, tokens, step_size=128)
    else:
        importance = score_tokens(model, tokens, step_size=128)
        assert importance.shape == (M,) and mx.all(mx.isfinite(importance)).item()
    assert no_wrappers(model)


def test_sliding_window_adds_the_last_window_only_when_the_prompt_is_longer():
    model = build(HYBRID_CASES["gemma3-small-window"])  # window 64
    tokens = random_tokens(M)
    recorder = RecordingRoPE(rope_owners(model)[1].rope)  # the global layer
    rope_owners(model)[1].rope = recorder
    kept = mx.concatenate([mx.arange(32), mx.array([M - 1])])
    sparse_prefill(model, tokens, kept, make_prompt_cache(model), step_size=512)
    cleanup_rope(model)
    recorder.calls.clear()  # the first pass also held positions.py's one-time probe
    sparse_prefill(model, tokens, kept, make_prompt_cache(model), step_size=512)
    cleanup_rope(model)
    rotated = {p for offset, n in recorder.calls for p in range(offset, offset + n)}
    assert rotated == set(range(32)) | set(range(M - 64, M))
    recorder.calls.clear()
    short = tokens[:60]  # shorter than the window: nothing added
    sparse_prefill(model, short, mx.array([0, 1, 59]), make_prompt_cache(model))
    cleanup_rope(model)
    assert {p for offset, n in recorder.calls for p in range(offset, offset + n)} == {0, 1, 59}


def test_sliding_window_layers_are_not_scored():
    """Scores come from the full-attention layer alone when windows cannot see the prompt."""
    model = build(HYBRID_CASES["gemma3-small-window"])
    importance = score_tokens(model, random_tokens(M))
    assert importance.shape == (M,)
    select_chunks(importance, 0.3)


def test_models_without_attention_are_refused_clearly():
    model = build(MAMBA)
    tokens = random_tokens(64)
    with pytest.raises(UnsupportedModelError, match="no attention"):
        sparse_prefill(model, tokens, mx.arange(64), make_prompt_cache(model))
    with pytest.raises(UnsupportedModelError):
        score_tokens(model, tokens)


class Rotation(nn.Module):
    """A rope whose call takes no offset: positions cannot be supplied to it."""

    def __call__(self, x):
        return x


def test_unknown_rope_is_refused_clearly():
    model = build(ROPE_CASES["llama"])
    for layer in model.layers:
        layer.self_attn.rope = Rotation()
    tokens = random_tokens(64)
    with pytest.raises(UnsupportedModelError, match="unknown RoPE Rotation"):
        sparse_prefill(model, tokens, mx.arange(64), make_prompt_cache(model))
    with pytest.raises(UnsupportedModelError, match="unknown RoPE"):
        score_tokens(model, tokens)


def test_a_draft_with_another_tokenizer_is_refused(tmp_path):
    draft = tmp_path / "draft"
    shutil.copytree(DEMO_DRAFT, draft)
    config = (draft / "tokenizer_config.json").read_text()
    (draft / "tokenizer_config.json").write_text(
        config.replace('"<|end|>"\n  ]', '"<|end|>",\n    "<|extra|>"\n  ]'))
    engine = Engine(draft=str(draft), model=None)
    with pytest.raises(ModelLoadError, match="tokenizer"):
        engine.start_sync()
    engine.shutdown_sync()


def test_engine_falls_back_to_dense_for_an_unsupported_target(tmp_path):
    target = save_with_demo_tokenizer(MAMBA, tmp_path / "mamba")
    with Engine(model=str(target), draft=str(DEMO_DRAFT)) as engine:
        prompt = list(range(10, 300))
        fallback = engine.generate_sync(prompt, max_tokens=6, specprefill=True)
        dense = engine.generate_sync(prompt, max_tokens=6, specprefill=False)
    assert not fallback.specprefill.engaged
    assert "fell back to dense" in fallback.specprefill.reason and "no attention" in fallback.specprefill.reason
    assert fallback.token_ids == dense.token_ids
