"""A long request through the engine against the bare prefill it runs, in one fresh
process: what the engine adds beyond the prefill, and whether the first request of a
process costs more than the next.

For each length: the engine's TTFT for its first and second request (different
prompts of the same length, prefix caches off), dense and SpecPrefill (keep 0.3, and
with the automatic policy), next to the bare work measured right after in the same
process: the target's chunked prefill to the first token's logits (dense), and the
draft's scoring + selection + sparse prefill (SpecPrefill), with the engine's chunk
sizes. Ratios: engine / bare (goal <= 1.05x) and first / second request (goal <= 1.1x).

    .venv/bin/python benchmarks/first_request.py --lengths 4096                 # CPU, demo pair
    python benchmarks/first_request.py --target-shape qwen3-8b --lengths 32768  # GPU
    python benchmarks/first_request.py --target 1.5B --draft 0.5B --lengths 16384  # real pair
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

from specprefill_engine import Engine
from specprefill_engine.core import chunked_prefill, cleanup_rope, score_tokens, select_chunks
from specprefill_engine.core import sparse_prefill
from specprefill_engine.core.scoring import run_steps
from specprefill_engine.loading import DEMO_DRAFT, load_model

from random_models import add_pair_arguments, random_pair


def prompt(length: int, seed: int) -> list:
    return np.random.default_rng(seed).integers(10, 4000, length).tolist()


def engine_ttft(engine, ids: list, **options) -> float:
    result = engine.generate_sync(ids, max_tokens=1, cache_prompt=False, **options)
    return result.timings.time_to_first_token


def bare(target, draft, ids: list, step: int, draft_step: int, keep: float) -> dict:
    """The same work without the engine, median of three after a warm-up."""
    tokens = mx.array(ids)

    def dense():
        mx.eval(run_steps(chunked_prefill(target, tokens, make_prompt_cache(target), step)))

    def sparse():
        importance = score_tokens(draft, tokens, step_size=draft_step)
        kept = select_chunks(importance, keep)
        try:
            mx.eval(sparse_prefill(target, tokens, kept, make_prompt_cache(target), step))
        finally:
            cleanup_rope(target)

    times = {}
    for name, work in (("dense", dense), ("specprefill", sparse)):
        work()
        runs = []
        for _ in range(3):
            mx.synchronize()
            started = time.perf_counter()
            work()
            mx.synchronize()
            runs.append(time.perf_counter() - started)
        times[name] = statistics.median(runs)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--target", help="target model folder (instead of --target-shape)")
    parser.add_argument("--draft", help="draft model folder (with --target)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    target_path, draft_path = (args.target, args.draft) if args.target else random_pair(args)
    rows = []
    started = time.perf_counter()
    with Engine(model=target_path, draft=draft_path, keep=args.keep, prefix_cache_bytes=0,
                draft_prefix_cache_bytes=0) as engine:
        load_s = time.perf_counter() - started
        step, draft_step = engine.info.step_size, engine._worker.runtime.config.draft_step_size
        for length in args.lengths:
            row = {"length": length, "load_s": load_s}
            for name, options in (("dense", {"specprefill": False}),
                                  ("specprefill", {"specprefill": True}),
                                  ("policy", {"specprefill": None})):
                first = engine_ttft(engine, prompt(length, 1), **options)
                second = engine_ttft(engine, prompt(length, 2), **options)
                third = engine_ttft(engine, prompt(length, 3), **options)
                row[name] = {"first_s": first, "second_s": second, "third_s": third,
                             "first_over_later": first / statistics.median([second, third])}
            rows.append(row)
    target, _ = load_model(target_path) if target_path else load_model()
    draft, _ = load_model(draft_path) if draft_path else load_model(default=DEMO_DRAFT)
    for row in rows:
        times = bare(target, draft, prompt(row["length"], 4), step, draft_step, args.keep)
        for name in ("dense", "specprefill"):
            later = statistics.median([row[name]["second_s"], row[name]["third_s"]])
            row[name]["bare_s"] = times[name]
            row[name]["engine_over_bare"] = later / times[name]
        print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
