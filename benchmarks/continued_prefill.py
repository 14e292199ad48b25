"""A prompt continued from a cached prefix against the same prompt from 0, the first
time each cut point is met: what a new chunk shape costs on top of its compute.

An agent's turn continues a cached prefix of a length no earlier turn had. MLX's CUDA
attention (cuDNN) builds an execution plan per shape and stride of its inputs, so a
chunk of a shape not seen before pays that build. Rows, in one process, after a
warm-up prefill from 0: the prefill from 0 again (every shape seen); the continuation
in plain `--step`-token chunks from the cut, with mlx-lm's cache growth (new shapes
for every chunk); and `chunked_prefill`'s (chunks on the grid of a prefill from 0,
buffers of exactly their length: new shapes only for the first and the last chunk).
Each continuation row runs at cut points never met before in the process, and then
again at the same points (every shape seen).

    python benchmarks/continued_prefill.py --target-shape qwen3-8b --tokens 32768  # GPU
    .venv/bin/python benchmarks/continued_prefill.py --tokens 4096 --step 256      # CPU
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine.core import chunked_prefill
from specprefill_engine.core.scoring import run_steps
from specprefill_engine.loading import load_model

from random_models import add_pair_arguments, random_pair


def timed(work) -> float:
    mx.synchronize()
    started = time.perf_counter()
    work()
    mx.synchronize()
    return time.perf_counter() - started


def from_zero(model, ids: mx.array, step: int) -> None:
    mx.eval(run_steps(chunked_prefill(model, ids, make_prompt_cache(model), step,
                                      balanced=False)))


def prefix(model, ids: mx.array, cut: int) -> list:
    cache = make_prompt_cache(model)
    model(ids[None, :cut], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def plain_chunks(model, ids: mx.array, cache: list, cut: int, step: int) -> None:
    """From `cut` in `step`-token chunks, mlx-lm's cache growth (as mlx-lm's own
    generate does after its prompt cache)."""
    for start in range(cut, ids.size, step):
        model(ids[None, start : start + step], cache=cache)
        mx.eval([c.state for c in cache])


def grid_chunks(model, ids: mx.array, cache: list, cut: int, step: int) -> None:
    mx.eval(run_steps(chunked_prefill(model, ids[cut:], cache, step, balanced=False)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--step", type=int, default=2048)
    parser.add_argument("--cuts", type=int, nargs="+", default=[283, 517, 1201])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    target_path, _ = random_pair(args)
    model, _ = load_model(target_path) if target_path else load_model()
    ids = mx.array(np.random.default_rng(0).integers(10, 4000, args.tokens))
    timed(lambda: from_zero(model, ids, args.step))  # the process's first: kernel compiles
    row = {"tokens": args.tokens, "step": args.step, "cuts": args.cuts,
           "from_zero_s": statistics.median(timed(lambda: from_zero(model, ids, args.step))
                                            for _ in range(3))}
    for name, work in (("plain_chunks", plain_chunks), ("grid_chunks", grid_chunks)):
        # each row its own cut points (cut + 1 for the second row): none met before
        cuts = [cut + (name == "grid_chunks") for cut in args.cuts]
        new, seen = [], []
        for times in (new, seen):
            for cut in cuts:
                cache = prefix(model, ids, cut)  # outside the timing
                times.append(timed(lambda: work(model, ids, cache, cut, args.step)))
        row[name] = {"new_cut_s": statistics.median(new), "seen_cut_s": statistics.median(seen),
                     "new_over_from_zero": statistics.median(new) / row["from_zero_s"]}
    print(json.dumps(row, indent=2), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=2))


if __name__ == "__main__":
    main()
