"""Quantized KV (kv_bits) on the demo pair: mlx-lm's tokens, sparse views at true
positions, the prefix cache, the disk tier and what is refused."""

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from models import build, ROPE_CASES
from specprefill_engine import Engine
from specprefill_engine.core import cleanup_rope, score_tokens, select_chunks, sparse_prefill
from specprefill_engine.core.quantized_kv import QuantizedKV, quantized_kv_support
from specprefill_engine.core.scoring import default_draft_step_size
from specprefill_engine.demo_tasks import make_case

pytestmark = pytest.mark.timeout(300)
ONE_CHUNK = 4096  # prefill units longer than the prompts: one forward, as mlx-lm's


def prompt_ids(tokenizer, seed, n_tokens, kind="passkey") -> list:
    case = make_case(tokenizer, seed, kind, n_tokens)
    return tokenizer.apply_chat_template(case.messages, add_generation_prompt=True)


def mlx_lm_tokens(model, ids, n, **kv) -> list:
    return [t for t, _ in generate_step(mx.array(ids), model, max_tokens=n, **kv)]


def until_eos(tokens: list, tokenizer) -> list:
    out = []
    for token in tokens:
        if token in tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("bits", [8, 4])
def test_dense_quantized_kv_equals_mlx_lm_generate_step(demo_pair, fresh_cache_dir, bits):
    model, _, tokenizer = demo_pair
    ids = prompt_ids(tokenizer, 1, 700)
    with Engine(kv_bits=bits, quantized_kv_start=0, step_size=ONE_CHUNK) as engine:
        from_zero = engine.generate_sync(ids, max_tokens=24, specprefill=False)
    # from the 720th entry on: the prompt at the model's dtype, the reply's end quantized
    with Engine(kv_bits=bits, quantized_kv_start=len(ids) + 8, step_size=ONE_CHUNK) as engine:
        later = engine.generate_sync(ids, max_tokens=24, specprefill=False)
    assert from_zero.token_ids == until_eos(
        mlx_lm_tokens(model, ids, 24, kv_bits=bits, quantized_kv_start=0), tokenizer)
    assert later.token_ids == until_eos(
        mlx_lm_tokens(model, ids, 24, kv_bits=bits, quantized_kv_start=len(ids) + 8), tokenizer)
    assert from_zero.specprefill.batch_reason.startswith(f"kv_bits={bits}")


def test_sparse_prefill_with_quantized_kv_at_true_positions(demo_pair, fresh_cache_dir):
    """The engine's sparse view, quantized, decodes as the core's sparse prefill of the
    same selection, quantized as mlx-lm does, decodes."""
    model, draft, tokenizer = demo_pair
    ids = prompt_ids(tokenizer, 3, 2000, "registry")
    kv = QuantizedKV(8, 64, 0)
    with Engine(kv_bits=8, quantized_kv_start=0, step_size=ONE_CHUNK, keep=0.3) as engine:
        result = engine.generate_sync(ids, max_tokens=16, specprefill=True)
    assert result.specprefill.engaged
    importance = score_tokens(draft, mx.array(ids), step_size=default_draft_step_size())
    kept = np.asarray(select_chunks(importance, 0.3)).astype(np.int64)
    assert hashlib.sha1(np.sort(kept).tobytes()).hexdigest()[:16] == \
        result.specprefill.selection_digest  # the same selection
    cache = make_prompt_cache(model)
    try:
        logits = sparse_prefill(model, mx.array(ids), mx.array(kept), cache, step_size=ONE_CHUNK)
        kv.apply(cache)  # after the prefill's forward, as mlx-lm's generate_step
        assert all(isinstance(c, QuantizedKVCache) for c in cache)
        tokens = [mx.argmax(logits[:, -1], axis=-1).item()]
        while len(tokens) < 16:  # the rope's shift moves each step to its true position
            logits = model(mx.array([[tokens[-1]]]), cache=cache)[:, -1]
            kv.apply(cache)
            tokens.append(mx.argmax(logits, axis=-1).item())
    finally:
        cleanup_rope(model)
    assert result.token_ids == until_eos(tokens, tokenizer)
    assert result.specprefill.kept_tokens == kept.size


def test_quantized_prefix_cache_and_disk_tier_serve_the_next_turn(demo_pair, fresh_cache_dir):
    _, _, tokenizer = demo_pair
    turn = make_case(tokenizer, 5, "passkey", 1200).messages
    settings = dict(kv_bits=8, quantized_kv_start=256, densify="off",
                    prefix_cache_disk_bytes=1 << 30, cache_dir=str(fresh_cache_dir))
    with Engine(**settings) as engine:
        first = engine.generate_sync(turn, max_tokens=12, specprefill=False)
        grown = turn + [{"role": "assistant", "content": first.text},
                        {"role": "user", "content": "And once more?"}]
        again = engine.generate_sync(grown, max_tokens=12, specprefill=False)
    assert again.usage.cached_tokens > 1000  # the quantized entry was restored
    with Engine(**settings) as fresh:  # a fresh process reads it back from the disk tier
        cold = fresh.generate_sync(grown, max_tokens=12, specprefill=False)
    assert "(disk)" in cold.specprefill.reuse
    assert cold.token_ids == again.token_ids
    with Engine(**{**settings, "kv_bits": None}) as plain:  # another setting's files: unseen
        other = plain.generate_sync(grown, max_tokens=12, specprefill=False)
    assert other.usage.cached_tokens == 0


def test_speculative_decoding_with_quantized_kv_gives_the_plain_reply(demo_pair,
                                                                      fresh_cache_dir):
    _, _, tokenizer = demo_pair
    ids = prompt_ids(tokenizer, 7, 600)
    with Engine(kv_bits=8, quantized_kv_start=0, step_size=ONE_CHUNK) as engine:
        plain = engine.generate_sync(ids, max_tokens=20, specprefill=False)
        drafted = engine.generate_sync(ids, max_tokens=20, specprefill=False, num_draft_tokens=3)
    assert drafted.specprefill.drafted_tokens > 0
    # a round's forward reads the quantized cache as one-token steps do, up to rounding
    assert drafted.token_ids[:8] == plain.token_ids[:8]


def test_a_model_that_cannot_quantize_is_refused_by_name(tmp_path):
    model = build(ROPE_CASES["gemma3"])  # sliding-window layers: mlx-lm cannot quantize them
    assert "RotatingKVCache" in quantized_kv_support(model, QuantizedKV(8))


def test_kv_bits_settings_are_checked():
    with pytest.raises(ValueError, match="kv_bits"):
        Engine(kv_bits=3)
    with pytest.raises(ValueError, match="kv_group_size"):
        Engine(kv_bits=8, kv_group_size=48)
    with pytest.raises(ValueError, match="quantized_kv_start"):
        Engine(kv_bits=8, quantized_kv_start=-1)


def test_the_cli_and_serve_take_the_memory_flags():
    from specprefill_engine.cli import make_engine, parser

    for command in (["serve"], ["ask", "notes.txt", "-q", "why?"]):
        args = parser().parse_args(command + ["--kv-bits", "4", "--kv-group-size", "32",
                                              "--quantized-kv-start", "0", "--kv-cache-gb", "2"])
        engine = make_engine(args)
        assert (engine.config.kv_bits, engine.config.kv_group_size,
                engine.config.quantized_kv_start, engine.config.kv_cache_bytes) == \
            (4, 32, 0, 2_000_000_000)
        engine.shutdown_sync()


def test_a_repair_forward_masks_quantized_layers_by_position(demo_pair):
    """The cache is quantized after the windows were made (as after a chunk): the repair
    forward's mask by position reaches the quantized layers, which hold every entry."""
    import numpy as np
    from specprefill_engine.core.prefill import prefill_chunk
    from specprefill_engine.core.windows import SlidingWindows

    target, _, _ = demo_pair
    held = np.concatenate([np.arange(0, 100), np.arange(250, 400)])
    cache = make_prompt_cache(target)
    prefill_chunk(target, mx.array(np.arange(10, 10 + held.size)), cache, held)
    windows = SlidingWindows(cache, held)
    QuantizedKV(8, 64, 0).apply(cache)
    chunk = np.concatenate([np.arange(130, 160), np.arange(400, 410)])
    with windows.by_position(chunk):
        assert all(isinstance(layer, QuantizedKVCache) for layer in windows.plain)
        masks = [layer.make_mask(chunk.size) for layer in cache]
        logits = prefill_chunk(target, mx.array(np.arange(500, 500 + chunk.size)), cache)
    keys = np.concatenate([held, chunk])
    assert all(m is masks[0] for m in masks)
    assert np.array_equal(np.array(masks[0]), keys[None] <= chunk[:, None])
    assert cache[0].offset == keys.size and logits is None
