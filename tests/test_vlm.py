"""SpecPrefill on mlx-vlm language models with multi-axis RoPE (explicit position_ids)."""

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from models import BASE, kept_chunks, random_tokens
from specprefill_engine.core import cleanup_rope, sparse_prefill

pytest.importorskip("mlx_vlm", reason="the `vlm` extra (mlx-vlm) is not installed")

FAMILIES = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
M = 300


def tiny_vlm_language_model(model_type: str, seed: int = 0) -> nn.Module:
    """The text side of a random-weight mlx-vlm model (what text-only requests run)."""
    config = importlib.import_module(f"mlx_vlm.models.{model_type}.config")
    language = importlib.import_module(f"mlx_vlm.models.{model_type}.language")
    text = config.TextConfig.from_dict({
        **BASE, "model_type": model_type,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}})
    model_config = config.ModelConfig(text_config=text, vision_config=config.VisionConfig(),
                                      model_type=model_type)
    mx.random.seed(seed)
    model = language.LanguageModel(text, model_config)
    model.set_dtype(mx.float32)
    mx.eval(model.parameters())
    return model


class PositionRecorder(nn.Module):
    """Wraps the language model's decoder stack and keeps the position_ids it gets."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.seen = []

    def __getattr__(self, name):  # embed_tokens, layers, norm, ...: the wrapped stack's
        if name in self or self.get("inner") is None:
            return super().__getattr__(name)
        return getattr(self["inner"], name)

    def __call__(self, *args, position_ids=None, **kwargs):
        self.seen.append(None if position_ids is None else np.array(position_ids))
        return self.inner(*args, position_ids=position_ids, **kwargs)


def layer0(cache, length):
    return cache[0].keys[..., :length, :]


@pytest.mark.parametrize("prefix", [0, 1000])
@pytest.mark.parametrize("family", FAMILIES)
def test_kept_tokens_reach_the_model_at_their_original_positions(family, prefix):
    model = tiny_vlm_language_model(family)
    tokens = random_tokens(prefix + M)
    kept = kept_chunks(M)
    cache = make_prompt_cache(model)
    if prefix:
        model(tokens[None, :prefix], cache=cache)
    recorder = PositionRecorder(model.model)
    model.model = recorder
    sparse_prefill(model, tokens[prefix:], kept, cache, step_size=64, position_offset=prefix)
    seen = np.concatenate([p.reshape(-1, p.shape[-1])[0] for p in recorder.seen])
    assert seen.tolist() == (np.array(kept) + prefix).tolist()  # not a dense run
    model.model = recorder.inner
    cleanup_rope(model)


@pytest.mark.parametrize("prefix", [0, 1000])
@pytest.mark.parametrize("family", FAMILIES)
def test_layer0_keys_and_the_first_decode_key_match_dense(family, prefix):
    model = tiny_vlm_language_model(family)
    tokens = random_tokens(prefix + M)
    kept = kept_chunks(M)
    dense, sparse = make_prompt_cache(model), make_prompt_cache(model)
    step = mx.array([[7]])
    model(tokens[None], cache=dense) if not prefix else (
        model(tokens[None, :prefix], cache=dense), model(tokens[None, prefix:], cache=dense))
    model(step, cache=dense)
    cleanup_rope(model)  # a fresh request: clear what the dense run left on the model
    if prefix:
        model(tokens[None, :prefix], cache=sparse)
    sparse_prefill(model, tokens[prefix:], kept, sparse, step_size=64, position_offset=prefix)
    expected = layer0(dense, prefix + M)[..., prefix + kept, :]
    got = layer0(sparse, prefix + kept.size)[..., prefix:, :]
    assert mx.abs(got - expected).max().item() <= 1e-4
    model(step, cache=sparse)  # plain decode call: lands at prefix + M
    new_dense = dense[0].keys[..., prefix + M, :]
    new_sparse = sparse[0].keys[..., prefix + kept.size, :]
    assert mx.abs(new_dense - new_sparse).max().item() <= 1e-4
    cleanup_rope(model)
    assert model._rope_deltas is None


def greedy(model, cache, logits, n=6):
    tokens = [mx.argmax(logits[0]).item()]
    while len(tokens) < n:
        tokens.append(mx.argmax(model(mx.array([[tokens[-1]]]), cache=cache).logits[0, -1]).item())
    return tokens


def dense_greedy(model, tokens):
    cache = make_prompt_cache(model)
    try:
        return greedy(model, cache, model(tokens[None], cache=cache).logits[:, -1])
    finally:
        cleanup_rope(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_keep_all_is_dense_and_later_dense_requests_are_unaffected(family):
    model = tiny_vlm_language_model(family)
    tokens = random_tokens(M)
    reference = dense_greedy(model, tokens)
    cache = make_prompt_cache(model)
    try:
        assert greedy(model, cache, sparse_prefill(model, tokens, mx.arange(M), cache, step_size=M)) == reference
    finally:
        cleanup_rope(model)
    cache = make_prompt_cache(model)
    sparse_prefill(model, tokens, kept_chunks(M), cache)  # a sparse request...
    greedy(model, cache, model(mx.array([[3]]), cache=cache).logits[:, -1])
    cleanup_rope(model)
    assert dense_greedy(model, tokens) == reference  # ...leaves nothing behind

    def fail():
        raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError):
        sparse_prefill(model, tokens, kept_chunks(M), make_prompt_cache(model), step_size=32,
                       cancel_check=fail)
    assert model._rope_deltas is None
    assert dense_greedy(model, tokens) == reference


def test_the_engine_serves_a_vision_language_model_text_only(tmp_path):
    """A saved tiny Qwen2-VL loads through mlx-vlm; text requests get SpecPrefill and
    keep 1.0 equals dense, with requests interleaved on the shared model."""
    import asyncio

    from models import save_vlm_with_demo_tokenizer
    from specprefill_engine import Engine
    from specprefill_engine.loading import DEMO_DRAFT

    path = save_vlm_with_demo_tokenizer(tmp_path / "vlm")
    prompt = random_tokens(600, vocab=4000).tolist()

    async def run():
        async with Engine(model=str(path), draft=str(DEMO_DRAFT), threshold=256,
                          prefix_cache_bytes=0) as engine:
            dense = await engine.generate(prompt, max_tokens=8, specprefill=False)
            full, sparse, dense_again = await asyncio.gather(
                engine.generate(prompt, max_tokens=8, keep=1.0, specprefill=True),
                engine.generate(prompt, max_tokens=8, keep=0.3, specprefill=True),
                engine.generate(prompt, max_tokens=8, specprefill=False),
            )
        return dense, full, sparse, dense_again

    dense, full, sparse, dense_again = asyncio.run(run())
    assert full.specprefill.engaged and sparse.specprefill.engaged
    assert sparse.specprefill.kept_tokens < 600
    assert full.token_ids == dense.token_ids == dense_again.token_ids
    # position-id models decode one request per forward, and say so
    assert not sparse.specprefill.batched and "rope-delta" in sparse.specprefill.batch_reason


def test_langchain_chat_model_accepts_a_vision_language_model(tmp_path):
    from langchain_specprefill import ChatSpecPrefill
    from models import save_vlm_with_demo_tokenizer
    from specprefill_engine.loading import DEMO_DRAFT

    path = save_vlm_with_demo_tokenizer(tmp_path / "vlm")
    llm = ChatSpecPrefill(model=str(path), draft=str(DEMO_DRAFT), max_tokens=4, specprefill=True)
    message = llm.invoke("def main():\n    return 1\n" * 20)
    assert message.usage_metadata["output_tokens"] == 4
    assert message.response_metadata["specprefill"]["engaged"]
