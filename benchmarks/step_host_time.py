"""Host time per decode step at N streams, four ways alternating in one process:
mlx-lm's `BatchGenerator`, the engine streamed (`Engine.stream`, one task per request)
and not (`Engine.generate`), and the engine's `DecodeBatch` driven alone on a thread.

For each step in the window where all N requests decode: the wall time and the CPU
time of the thread that builds the step's graph (the engine's worker, or the caller's
thread for `BatchGenerator` and `DecodeBatch`), plus the caller's event-loop thread's
CPU time for `Engine.stream`. Where decode is bound by the host (an 8B model on an
H200) the worker's CPU time is the step's wall time, and this shows how much of a step
goes to the engine's own work and how much to the host's speed.

    .venv/bin/python benchmarks/step_host_time.py                                # CPU, demo target
    python benchmarks/step_host_time.py --shape qwen3-8b --repeats 6             # GPU, random weights
"""

import asyncio
import json
import statistics
import threading
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from random_models import random_model_dir
from specprefill_engine import Engine
from specprefill_engine.core.prefill import chunked_prefill
from specprefill_engine.core.scoring import run_steps
from specprefill_engine.engine.batch import DecodeBatch
from specprefill_engine.engine.sampling import GREEDY
from specprefill_engine.loading import load_model
from throughput import decode_arguments, prompts


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def per_step(marks: list, streams: int) -> dict:
    """marks: (wall, builder CPU, loop CPU) at each step of the window ({} if none)."""
    count = len(marks) - 1
    if count < 1:
        return {}
    wall, builder, loop = (marks[-1][i] - marks[0][i] for i in range(3))
    return {"steps": count, "wall_ms": 1e3 * wall / count, "builder_cpu_ms": 1e3 * builder / count,
            "loop_cpu_ms": 1e3 * loop / count, "tok_s": streams * count / wall}


def batch_generator(model, batch: list, new_tokens: int) -> dict:
    generator = BatchGenerator(model, max_tokens=new_tokens, stop_tokens=None,
                               completion_batch_size=len(batch))
    generator.insert(batch, [new_tokens] * len(batch))
    me, marks = threading.get_ident(), []
    while responses := generator.next_generated():
        if len(responses) == len(batch) and all(r.finish_reason is None for r in responses):
            marks.append((time.perf_counter(), thread_cpu(me), 0.0))
    generator.close()
    return per_step(marks[2:], len(batch))


async def engine_stream(engine, batch: list, new_tokens: int) -> dict:
    worker, me = engine._worker.thread.ident, threading.get_ident()
    counts, marks = [0] * len(batch), []

    async def one(index, ids):
        async for chunk in engine.stream(ids, max_tokens=new_tokens, ignore_eos=True,
                                         specprefill=False, cache_prompt=False):
            if chunk.token_ids:
                counts[index] += 1
                if index == len(batch) - 1 and min(counts) > 0 and max(counts) < new_tokens:
                    marks.append((time.perf_counter(), thread_cpu(worker), thread_cpu(me)))

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    return per_step(marks[2:], len(batch))


async def engine_generate(engine, batch: list, new_tokens: int) -> dict:
    """No per-token events: end to end only (prefill included), and the worker's CPU."""
    worker, me = engine._worker.thread.ident, threading.get_ident()
    started, worker_cpu, loop_cpu = time.perf_counter(), thread_cpu(worker), thread_cpu(me)
    await asyncio.gather(*(engine.generate(ids, max_tokens=new_tokens, ignore_eos=True,
                                           specprefill=False, cache_prompt=False)
                           for ids in batch))
    wall = time.perf_counter() - started
    return {"e2e_tok_s": len(batch) * new_tokens / wall,
            "builder_cpu_ms_per_token": 1e3 * (thread_cpu(worker) - worker_cpu) / new_tokens,
            "loop_cpu_ms": 1e3 * (thread_cpu(me) - loop_cpu)}


def decode_batch_alone(model, batch: list, new_tokens: int, step_size: int) -> dict:
    """The engine's batch step without the engine: rows prefilled, added, stepped."""
    out = {}

    def work():
        decode = DecodeBatch(model)
        for handle, ids in enumerate(batch):
            cache = make_prompt_cache(model)
            logits = run_steps(chunked_prefill(model, mx.array(ids), cache, step_size))
            decode.add(handle, GREEDY, cache, mx.argmax(logits[0, -1]).item(), 0)
        me, marks = threading.get_ident(), []
        for _ in range(new_tokens):
            decode.step()
            marks.append((time.perf_counter(), thread_cpu(me), 0.0))
        out.update(per_step(marks[2:], len(batch)))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return out


async def main_async(args) -> dict:
    path = random_model_dir(args.shape) if args.shape else None
    model, _ = load_model(path) if path else load_model()
    batch = prompts(args.streams, args.prompt, 4000, args.streams)
    runs = {"batch_generator": [], "engine_stream": [], "engine_generate": [],
            "decode_batch_alone": []}
    async with Engine(model=path, draft=None, max_batch_size=args.streams) as engine:
        step_size = engine.info.step_size
        await engine_stream(engine, batch, 8)  # warm up every path
        batch_generator(model, batch, 8)
        decode_batch_alone(model, batch, 8, step_size)
        for _ in range(args.repeats):  # alternating, so the host's drifts hit every side
            runs["batch_generator"].append(batch_generator(model, batch, args.new_tokens))
            runs["engine_stream"].append(await engine_stream(engine, batch, args.new_tokens))
            runs["engine_generate"].append(await engine_generate(engine, batch, args.new_tokens))
            runs["decode_batch_alone"].append(
                decode_batch_alone(model, batch, args.new_tokens, step_size))
            print(json.dumps({name: values[-1] for name, values in runs.items()}), flush=True)
    result = {name: {key: statistics.median(run[key] for run in values) for key in values[0]}
              for name, values in runs.items()}
    result["runs"] = runs
    return result


def main():
    parser = decode_arguments(__doc__, repeats=5)
    parser.add_argument("--streams", type=int, default=16)
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
