"""One decoding stream four ways, alternating in one process: mlx-lm's `generate_step`
on the main thread and on a worker thread, and the engine streamed (`Engine.stream`:
the caller's event loop wakes for every token) and not (`Engine.generate`: decode
tokens/s from the Result's timings). Where decode is bound by the host (an 8B model on
an H200), this separates the cost of the engine's decode from the cost of handing every
token to an event loop that shares the GIL with the worker.

    .venv/bin/python benchmarks/single_stream.py                         # CPU, demo target
    python benchmarks/single_stream.py --shape qwen3-8b --repeats 12     # GPU, random weights
"""

import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import generate_step

from random_models import random_model_dir
from specprefill_engine import Engine
from specprefill_engine.loading import load_model
from throughput import decode_arguments, prompts


def tokens_per_s(stamps: list) -> float:
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def step_on_this_thread(model, ids: list, new_tokens: int) -> float:
    stamps = []
    for _ in generate_step(mx.array(ids), model, max_tokens=new_tokens):
        stamps.append(time.perf_counter())
    return tokens_per_s(stamps)


def step_on_a_thread(model, ids: list, new_tokens: int) -> float:
    out = {}
    thread = threading.Thread(
        target=lambda: out.update(rate=step_on_this_thread(model, ids, new_tokens)))
    thread.start()
    thread.join()
    return out["rate"]


async def engine_stream(engine, ids: list, new_tokens: int) -> float:
    stamps = []
    async for _ in engine.stream(ids, max_tokens=new_tokens, ignore_eos=True,
                                 specprefill=False, cache_prompt=False):
        stamps.append(time.perf_counter())
    stamps.pop()  # the last chunk carries no token
    return tokens_per_s(stamps)


async def engine_generate(engine, ids: list, new_tokens: int) -> float:
    result = await engine.generate(ids, max_tokens=new_tokens, ignore_eos=True,
                                   specprefill=False, cache_prompt=False)
    return result.timings.decode_tokens_per_s


async def main_async(args) -> dict:
    path = random_model_dir(args.shape) if args.shape else None
    model, _ = load_model(path) if path else load_model()
    ids = prompts(1, args.prompt, 4000, 1)[0]
    runs = {"generate_step_main_thread": [], "generate_step_worker_thread": [],
            "engine_stream": [], "engine_generate": []}
    async with Engine(model=path, draft=None) as engine:
        await engine_stream(engine, ids, 8)  # warm up every path
        step_on_this_thread(model, ids, 8)
        step_on_a_thread(model, ids, 8)
        for _ in range(args.repeats):
            runs["generate_step_main_thread"].append(step_on_this_thread(model, ids, args.new_tokens))
            runs["generate_step_worker_thread"].append(step_on_a_thread(model, ids, args.new_tokens))
            runs["engine_stream"].append(await engine_stream(engine, ids, args.new_tokens))
            runs["engine_generate"].append(await engine_generate(engine, ids, args.new_tokens))
    base = statistics.median(runs["generate_step_main_thread"])
    summary = {name: {"tok_s": statistics.median(rates), "vs_generate_step":
                      statistics.median(rates) / base, "tok_s_runs": rates}
               for name, rates in runs.items()}
    for name, row in summary.items():
        print(f"{name:28s} {row['tok_s']:7.1f} tok/s  {row['vs_generate_step']:.2f}x  "
              f"runs {[round(r) for r in row['tok_s_runs']]}", flush=True)
    return summary


def main():
    args = decode_arguments(__doc__, repeats=6).parse_args()
    summary = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
