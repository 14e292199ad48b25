"""A lone row's decode step with its positions moved (a SpecPrefill row: N kept entries
decoding at M + t) against one at its cache's own positions, their steps alternating:
the wall time per step and the CPU time of the thread that builds and waits for it.
Where decode is bound by the host (an 8B model on an H200), the host time a moved row
adds is its decode's cost over a dense row's.

    .venv/bin/python benchmarks/shifted_decode.py                           # CPU, demo target
    .venv/bin/python benchmarks/shifted_decode.py --shape qwen3-8b-host     # 36 layers, host-bound
    python benchmarks/shifted_decode.py --shape qwen3-8b --prompt 32000     # GPU, random weights
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from random_models import random_model_dir
from specprefill_engine.core.prefill import chunked_prefill
from specprefill_engine.engine.batch import DecodeBatch
from specprefill_engine.loading import load_model


def interleaved(model, prompt: mx.array, shift: int, steps: int) -> dict:
    """Two lone rows after `prompt`, one at its own positions and one moved by `shift`,
    stepped in turn; per row the median wall and thread CPU ms of a step, evaluated."""
    batches = {}
    for moved in (0, shift):
        cache = make_prompt_cache(model)
        chunked_prefill(model, prompt[:-1], cache, 512)
        batches[moved] = DecodeBatch(model)
        batches[moved].add(0, None, cache, int(prompt[-1].item()), moved)
    times = {moved: ([], []) for moved in batches}
    for _ in range(steps):
        for moved, batch in batches.items():
            wall, cpu = time.perf_counter(), time.thread_time()
            batch.step()
            mx.eval(batch.inputs)
            times[moved][0].append(time.perf_counter() - wall)
            times[moved][1].append(time.thread_time() - cpu)
    return {moved: {"wall_ms": round(1e3 * statistics.median(walls), 3),
                    "cpu_ms": round(1e3 * statistics.median(cpus), 3)}
            for moved, (walls, cpus) in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", help="random-weight shape (random_models.py); default: demo target")
    parser.add_argument("--prompt", type=int, default=2048, help="tokens in the cache")
    parser.add_argument("--shift", type=int, default=5000, help="positions a moved row skips")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--json", help="write the result here")
    args = parser.parse_args()
    model, _ = load_model(random_model_dir(args.shape)) if args.shape else load_model()
    prompt = mx.random.randint(0, 4000, (args.prompt,), key=mx.random.key(0)).astype(mx.uint32)
    interleaved(model, prompt, args.shift, 8)  # kernels compiled for both
    result = interleaved(model, prompt, args.shift, args.steps)
    summary = {"own positions": result[0], "moved": result[args.shift],
               "moved - own, cpu_ms": round(result[args.shift]["cpu_ms"] - result[0]["cpu_ms"], 3)}
    print(json.dumps(summary, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
