"""The automatic policy against what it predicts: for each prompt length and keep, the
engine's choice with `specprefill=None` (and its predictions), then dense and
SpecPrefill both forced, in one run on one engine (prefix caches off).

    .venv/bin/python benchmarks/policy.py --lengths 1024 2048 4096            # CPU, demo pair
    python benchmarks/policy.py --target-shape qwen3-8b --lengths 8192 32768 65536  # GPU
"""

import argparse
import json
from pathlib import Path

import numpy as np

from specprefill_engine import Engine

from random_models import add_pair_arguments, random_pair


def ttft(engine, ids, **options) -> tuple:
    result = engine.generate_sync(ids, max_tokens=2, cache_prompt=False, **options)
    return result.timings.time_to_first_token, result.specprefill


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    target, draft = random_pair(args)
    rows = []
    with Engine(model=target, draft=draft, threshold=1, prefix_cache_bytes=0,
                draft_prefix_cache_bytes=0) as engine:
        rng = np.random.default_rng(0)
        engine.generate_sync(rng.integers(10, 4000, 256).tolist(), max_tokens=2)  # warm-up
        for length in args.lengths:
            ids = rng.integers(10, 4000, length).tolist()
            ttft(engine, ids, specprefill=False)  # new shapes: compile before timing
            dense, _ = ttft(engine, ids, specprefill=False)
            for keep in args.keeps:
                ttft(engine, ids, specprefill=True, keep=keep)
                sparse, _ = ttft(engine, ids, specprefill=True, keep=keep)
                _, report = ttft(engine, ids, specprefill=None, keep=keep)
                rows.append({
                    "length": length, "keep": keep, "dense_s": dense, "specprefill_s": sparse,
                    "measured_gain": dense / sparse, "policy_engaged": report.engaged,
                    "predicted_dense_s": report.predicted_dense_s,
                    "predicted_specprefill_s": report.predicted_specprefill_s,
                    "reason": report.reason,
                })
                print(json.dumps(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
