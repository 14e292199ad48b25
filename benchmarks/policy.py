"""The automatic policy against what it predicts: for each prompt length and keep, the
engine's choice with `specprefill=None` (and its predictions), then dense and
SpecPrefill both forced, in one run on one engine (prefix caches off).

    .venv/bin/python benchmarks/policy.py --lengths 1024 2048 4096            # CPU, demo pair
    python benchmarks/policy.py --target-shape qwen3-8b --lengths 8192 32768 65536  # GPU

`--storm`: a user's session on a fresh cache folder instead, every request under the
policy with the prefix caches on: a retry storm first (one long prompt sent again and
again, short chats between), then new long prompts, then a new process on the same
folder; per request the choice, the predictions and the measured scoring + prefill
seconds. The retried prompt has the shortest of `--lengths`, the new ones the longest.

    .venv/bin/python benchmarks/policy.py --storm --lengths 1300 3000 --json docs/policy-storm-cpu.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_case

from random_models import add_pair_arguments, random_pair


def ttft(engine, ids, **options) -> tuple:
    result = engine.generate_sync(ids, max_tokens=2, cache_prompt=False, **options)
    return result.timings.time_to_first_token, result.specprefill


def storm_row(phase: str, result) -> dict:
    report = result.specprefill
    return {"phase": phase, "tokens": result.usage.prompt_tokens,
            "cached": result.usage.cached_tokens, "engaged": report.engaged,
            "reason": report.reason, "predicted_dense_s": report.predicted_dense_s,
            "predicted_specprefill_s": report.predicted_specprefill_s,
            "measured_s": result.timings.scoring + result.timings.prefill}


def storm(args, target, draft, process: str) -> list:
    """One process's part of the session (`process`: "first" or "next")."""
    rows, retried_length, length = [], min(args.lengths), max(args.lengths)
    with Engine(model=target, draft=draft) as engine:
        tokenizer = engine.tokenizer

        def ask(phase, messages):
            rows.append(storm_row(phase, engine.generate_sync(messages, max_tokens=8)))
            print(json.dumps(rows[-1]), flush=True)

        if process == "next":
            for seed in (20, 21):
                ask("new process", make_case(tokenizer, seed, "passkey", length).messages)
            return rows
        retried = make_case(tokenizer, 2, "passkey", retried_length).messages
        for round in range(args.retries):
            ask("retry storm", retried)
            if round % 2:
                ask("short chat", [{"role": "user", "content": f"hello {round}"}])
        for seed in (10, 11, 12):
            ask("after", make_case(tokenizer, seed, "passkey", length).messages)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_pair_arguments(parser)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--storm", action="store_true", help="a retry storm (see above)")
    parser.add_argument("--retries", type=int, default=6)
    parser.add_argument("--process", default="first", help=argparse.SUPPRESS)
    args = parser.parse_args()
    target, draft = random_pair(args)
    if args.storm:
        if args.process == "next":
            print(json.dumps(storm(args, target, draft, "next")))
            return
        os.environ.setdefault("SPECPREFILL_CACHE_DIR", tempfile.mkdtemp(prefix="storm-"))
        rows = storm(args, target, draft, "first")
        after = subprocess.run([sys.executable, *sys.argv, "--process", "next"], check=True,
                               capture_output=True, text=True)
        rows += json.loads(after.stdout.splitlines()[-1])
        print(*map(json.dumps, rows[-2:]), sep="\n")
        if args.json:
            Path(args.json).write_text(json.dumps(rows, indent=2))
        return
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
