"""Decode after a long prompt, by how its cache was made, alternating in one process.

In the agent loop the engine decoded each 150-token reply over a 32K cache more slowly
than mlx-lm's `generate_step` did after its own prefill. This separates where that can
come from, each side decoding the same reply length after the same prompt:
- `mlx-lm`: mlx-lm's chunked prefill (its cache grows by its own step), then
  `generate_step` on that cache;
- `mlx-lm, copied cache`: the same cache deep-copied first (what mlx-lm's prompt cache
  hands a later turn);
- `fit buffers`: the engine's prefill routine (`core.prefill.prefill_chunk`, whose
  buffers hold exactly the entries), then `generate_step`;
- `engine`: `Engine.stream`, no prefix cache; `engine, prefix hit`: the same prompt
  plus a few tokens, the prompt restored from the prefix cache.
Also the attention of a repaired prefill against a causal one, at the same sizes
(`--repair-queries`, `--repair-keys`): a repair masks by position (an array mask).

    python benchmarks/decode_context.py --shape qwen3-8b --prompt 32768 --new-tokens 150 --repeats 6
    .venv/bin/python benchmarks/decode_context.py --shape qwen3-small --prompt 4096   # CPU
"""

import asyncio
import copy
import json
import statistics
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from random_models import random_model_dir
from specprefill_engine import Engine
from specprefill_engine.core.prefill import prefill_chunk
from specprefill_engine.loading import load_model
from throughput import decode_arguments, prompts


def rate(stamps: list) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def mlx_lm_cache(model, ids: list, step: int) -> list:
    cache = make_prompt_cache(model)
    for start in range(0, len(ids) - 1, step):
        model(mx.array(ids[start : min(start + step, len(ids) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def fitted_cache(model, ids: list, step: int) -> list:
    cache = make_prompt_cache(model)
    for start in range(0, len(ids) - 1, step):
        prefill_chunk(model, mx.array(ids[start : min(start + step, len(ids) - 1)]), cache)
    return cache


def decode(model, ids: list, cache: list, new_tokens: int) -> float:
    stamps = [time.perf_counter() for _ in generate_step(mx.array(ids[-1:]), model,
                                                          max_tokens=new_tokens, prompt_cache=cache)]
    return rate(stamps)


async def engine_decode(engine, ids: list, new_tokens: int, cache_prompt: bool) -> float:
    stamps = []
    async for _ in engine.stream(ids, max_tokens=new_tokens, ignore_eos=True, specprefill=False,
                                 cache_prompt=cache_prompt):
        stamps.append(time.perf_counter())
    stamps.pop()  # the last chunk carries no token
    return rate(stamps)


def attention_times(queries: int, keys: int, heads: int, kv_heads: int, repeats: int) -> dict:
    """Seconds of one layer's attention for `queries` new tokens after `keys - queries`
    entries: causal, and by a boolean mask of the same pattern (a repair's)."""
    dtype = mx.bfloat16 if mx.default_device() == mx.gpu else mx.float32
    q = mx.random.normal((1, heads, queries, 128)).astype(dtype)
    k = mx.random.normal((1, kv_heads, keys, 128)).astype(dtype)
    v = mx.random.normal((1, kv_heads, keys, 128)).astype(dtype)
    mask = mx.arange(keys)[None] <= (keys - queries + mx.arange(queries))[:, None]
    mx.eval(q, k, v, mask)
    out = {}
    for name, m in (("causal", "causal"), ("mask by position", mask)):
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=128 ** -0.5, mask=m))
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times[1:])  # the first compiles
    out["ratio"] = out["mask by position"] / out["causal"]
    return out


async def main_async(args) -> None:
    path = random_model_dir(args.shape) if args.shape else None
    model, _ = load_model(path) if path else load_model()
    ids = prompts(1, args.prompt, 4000, 7)[0]
    more = ids + prompts(1, 16, 4000, 8)[0]
    runs = {name: [] for name in ("mlx-lm", "mlx-lm, copied cache", "fit buffers", "engine",
                                  "engine, prefix hit")}
    async with Engine(model=path, draft=None, densify="off") as engine:
        await engine_decode(engine, ids[:4096], 8, False)  # warm up
        decode(model, ids[:4096], mlx_lm_cache(model, ids[:4096], args.step), 8)
        for _ in range(args.repeats):
            cache = mlx_lm_cache(model, ids, args.step)
            runs["mlx-lm, copied cache"].append(decode(model, ids, copy.deepcopy(cache),
                                                       args.new_tokens))
            runs["mlx-lm"].append(decode(model, ids, cache, args.new_tokens))
            del cache
            runs["fit buffers"].append(decode(model, ids, fitted_cache(model, ids, args.step),
                                              args.new_tokens))
            runs["engine"].append(await engine_decode(engine, ids, args.new_tokens, False))
            await engine.generate(ids, max_tokens=1, specprefill=False)  # stores the prompt
            runs["engine, prefix hit"].append(await engine_decode(engine, more, args.new_tokens,
                                                                  True))
            mx.clear_cache()
    base = statistics.median(runs["mlx-lm"])
    summary = {name: {"tok_s": statistics.median(r), "vs_mlx_lm": statistics.median(r) / base,
                      "runs": r} for name, r in runs.items()}
    for name, row in summary.items():
        print(f"{name:24s} {row['tok_s']:7.1f} tok/s  {row['vs_mlx_lm']:.3f}x  "
              f"runs {[round(x, 1) for x in row['runs']]}", flush=True)
    config = model.args
    summary["attention"] = attention_times(args.repair_queries, args.repair_keys,
                                           config.num_attention_heads,
                                           config.num_key_value_heads, args.repeats)
    print("attention", json.dumps(summary["attention"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


def main():
    parser = decode_arguments(__doc__, repeats=4)
    parser.add_argument("--step", type=int, default=2048, help="prefill chunk")
    parser.add_argument("--repair-queries", type=int, default=6700)
    parser.add_argument("--repair-keys", type=int, default=16800)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
