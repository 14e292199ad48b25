"""Decode throughput of concurrent streams: the engine's batched decode against
mlx-lm on the same model and prompts, side by side in one run.

For 1, 4, 16 and 32 concurrent requests (512-token prompts, 128 new tokens each,
greedy, EOS ignored so every request makes all its tokens): aggregate decode
tokens/s in the steady window (from the moment every request has its first token
to the end) and p50 / p99 inter-token latency in that window; mlx-lm's `BatchGenerator` (what
`batch_generate` runs) and, for one stream, `generate_step`. Single runs are noisy
on a small CPU, so each stream count runs `--repeats` times, the engine and mlx-lm
alternating, and the row reports the medians (the per-repeat tokens/s in `tok_s_runs`).

Besides `tok_s` (steady window to the last token), each side reports
`tok_s_concurrent`, the window in which all N requests decode (from the last first
token to the first last token), and `e2e_tok_s`, every generated token over the
whole run from submission (prefill included). The engine prefills one request at a
time between decode steps, so its requests start staggered and the end of the
steady window has fewer than N streams; mlx-lm prefills them together.
Then the longest gap a decoding stream sees while another request prefills 8K
tokens, against the median scheduler turn of that prefill (medians over the repeats).
With `--special-rows`, at 16 streams: the engine with one row under a repetition
penalty, and with one constrained row (`response_format` json_object), against all
plain rows, the order rotating from repeat to repeat (a processor must not stop the
batch's pipelining).

    .venv/bin/python benchmarks/throughput.py                       # CPU, demo target
    python benchmarks/throughput.py --shape qwen3-8b --json out.json  # GPU, random weights
    .venv/bin/python benchmarks/throughput.py --special-rows --streams 16 --repeats 5
"""

import argparse
import asyncio
import importlib.util
import json
import statistics
import time
from pathlib import Path
from typing import Optional

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step

from random_models import random_model_dir
from specprefill_engine import Engine
from specprefill_engine.loading import load_model


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, vocab, length).tolist() for _ in range(n)]


def window_stats(stamps: list, submitted: float) -> dict:
    """stamps: per request, the arrival time of each token. Steady window: from the
    last request's first token to the last token of all; concurrent window: to the
    first request's last token."""
    start = max(s[0] for s in stamps)
    end = max(s[-1] for s in stamps)
    first_end = min(s[-1] for s in stamps)
    tokens = sum(sum(1 for t in s if t > start) for s in stamps)
    together = sum(sum(1 for t in s if start < t <= first_end) for s in stamps)
    steady = [np.asarray([t for t in s if t >= start]) for s in stamps]
    gaps = np.concatenate([np.diff(s) for s in steady if len(s) > 1])
    return {"tok_s": tokens / max(end - start, 1e-9),
            "itl_p50_ms": float(np.percentile(gaps, 50) * 1e3),
            "itl_p99_ms": float(np.percentile(gaps, 99) * 1e3),
            "tok_s_concurrent": together / max(first_end - start, 1e-9),
            "e2e_tok_s": sum(len(s) for s in stamps) / max(end - submitted, 1e-9)}


KEYS = ("tok_s", "itl_p50_ms", "itl_p99_ms", "tok_s_concurrent", "e2e_tok_s")


def medians(runs: list) -> dict:
    """The median of each measure over the repeats, and the repeats' tokens/s."""
    row = {key: statistics.median(run[key] for run in runs) for key in KEYS}
    row["tok_s_runs"] = [run["tok_s"] for run in runs]
    row["tok_s_concurrent_runs"] = [run["tok_s_concurrent"] for run in runs]
    return row


async def engine_run(engine, batch: list, new_tokens: int, first: Optional[dict] = None) -> dict:
    """`first`: extra options for the first request only."""
    stamps = [[] for _ in batch]
    submitted = time.perf_counter()

    async def one(index, ids):
        extra = first if index == 0 and first else {}
        async for _ in engine.stream(ids, max_tokens=new_tokens, ignore_eos=True,
                                     specprefill=False, cache_prompt=False, **extra):
            stamps[index].append(time.perf_counter())

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))
    for s in stamps:  # the last chunk carries no token: drop its stamp
        s.pop()
    return window_stats(stamps, submitted)


def mlx_lm_batch_run(model, batch: list, new_tokens: int) -> dict:
    generator = BatchGenerator(model, max_tokens=new_tokens, stop_tokens=None,
                               completion_batch_size=max(len(batch), 1))
    submitted = time.perf_counter()
    uids = generator.insert(batch, [new_tokens] * len(batch))
    stamps = {uid: [] for uid in uids}
    while responses := generator.next_generated():
        now = time.perf_counter()
        for response in responses:
            stamps[response.uid].append(now)
    generator.close()
    return window_stats(list(stamps.values()), submitted)


def mlx_lm_step_run(model, ids: list, new_tokens: int) -> dict:
    stamps = []
    submitted = time.perf_counter()
    for _ in generate_step(mx.array(ids), model, max_tokens=new_tokens):
        stamps.append(time.perf_counter())
    return window_stats([stamps], submitted)


async def prefill_stall(engine, vocab: int, long_tokens: int) -> dict:
    """A stream decodes while another request prefills `long_tokens` densely."""
    stamps, turns = [], []
    started = asyncio.Event()

    async def stream():
        async for _ in engine.stream(prompts(1, 64, vocab, 1)[0], max_tokens=100000,
                                     ignore_eos=True, specprefill=False, cache_prompt=False):
            stamps.append(time.perf_counter())
            started.set()

    task = asyncio.create_task(stream())
    await started.wait()
    began = time.perf_counter()
    await engine.generate(prompts(1, long_tokens, vocab, 2)[0], max_tokens=1, specprefill=False,
                          cache_prompt=False, on_progress=lambda p: turns.append(time.perf_counter()))
    ended = time.perf_counter()
    task.cancel()
    if len(turns) < 2:
        raise ValueError(f"--long-prompt {long_tokens} fits in one prefill unit: no turns to "
                         f"measure (use several times {engine.info.step_size} tokens)")
    gaps = np.diff([t for t in stamps if began <= t <= ended])
    turn = statistics.median(np.diff(turns))
    return {"longest_gap_s": float(gaps.max()), "median_turn_s": float(turn),
            "ratio": float(gaps.max() / turn)}


SPECIAL_ROWS = {"penalized": {"repetition_penalty": 1.1},
                "constrained": {"response_format": {"type": "json_object"}}}


async def special_rows(engine, args, vocab: int) -> list:
    """16 streams: one penalized or constrained row against none. Each kind runs once
    before timing (its first use compiles); then the kinds alternate, the order rotating
    from repeat to repeat so none always runs first."""
    batch = prompts(16, args.prompt, vocab, 16)
    special = dict(SPECIAL_ROWS)
    if importlib.util.find_spec("llguidance") is None:  # not installed here: no grammar row
        del special["constrained"]
    kinds = {"plain": None, **special}
    for options in kinds.values():
        await engine_run(engine, batch, 8, options)
    runs = {name: [] for name in kinds}
    names = list(kinds)
    for repeat in range(args.repeats):
        for name in names[repeat % len(names):] + names[: repeat % len(names)]:
            runs[name].append(await engine_run(engine, batch, args.new_tokens, kinds[name]))
    plain = medians(runs["plain"])
    rows = []
    for name in special:
        ours = medians(runs[name])
        rows.append({"special_row": name, "streams": 16, "repeats": args.repeats,
                     "with": ours, "without": plain,
                     "ratio": ours["tok_s"] / plain["tok_s"],
                     "ratio_runs": [a["tok_s"] / b["tok_s"]
                                    for a, b in zip(runs[name], runs["plain"])]})
        print(json.dumps(rows[-1]), flush=True)
    return rows


async def main_async(args) -> list:
    path = random_model_dir(args.shape) if args.shape else None
    vocab = 4000
    rows = []
    # at least 2: the stall measurement decodes one stream while another request prefills;
    # the special rows run 16 streams
    batch_size = max(*args.streams, 16 if args.special_rows else 2)
    async with Engine(model=path, draft=None, max_batch_size=batch_size) as engine:
        warm = prompts(2, args.prompt, vocab, 99)
        await engine_run(engine, warm, 8)
        if args.special_rows:
            return await special_rows(engine, args, vocab)
        model, _ = load_model(path) if path else load_model()
        mlx_lm_batch_run(model, warm, 8)
        for n in args.streams:
            batch = prompts(n, args.prompt, vocab, n)
            runs = {"engine": [], "mlx_lm_batch": [], "mlx_lm_generate_step": []}
            for _ in range(args.repeats):  # alternating, so drifts hit every side alike
                runs["engine"].append(await engine_run(engine, batch, args.new_tokens))
                runs["mlx_lm_batch"].append(mlx_lm_batch_run(model, batch, args.new_tokens))
                if n == 1:
                    runs["mlx_lm_generate_step"].append(
                        mlx_lm_step_run(model, batch[0], args.new_tokens))
            ours, theirs = medians(runs["engine"]), medians(runs["mlx_lm_batch"])
            row = {"streams": n, "repeats": args.repeats, "engine": ours, "mlx_lm_batch": theirs,
                   "ratio_vs_batch": ours["tok_s"] / theirs["tok_s"],
                   "ratio_vs_batch_concurrent":
                       ours["tok_s_concurrent"] / theirs["tok_s_concurrent"],
                   "ratio_vs_batch_e2e": ours["e2e_tok_s"] / theirs["e2e_tok_s"]}
            if n == 1:
                step = medians(runs["mlx_lm_generate_step"])
                row["mlx_lm_generate_step"] = step
                row["ratio_vs_generate_step"] = ours["tok_s"] / step["tok_s"]
            rows.append(row)
            print(json.dumps(row), flush=True)
        stalls = [await prefill_stall(engine, vocab, args.long_prompt)
                  for _ in range(args.repeats)]
        stall = {key: statistics.median(run[key] for run in stalls) for key in stalls[0]}
        stall["ratio_runs"] = [run["ratio"] for run in stalls]
        rows.append({"prefill_stall": stall, "step_size": engine.info.step_size})
        print(json.dumps(rows[-1]), flush=True)
    return rows


def decode_arguments(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The options the decode benchmarks share (this one, single_stream, step_host_time)."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--shape", help="random-weight Qwen3 shape (e.g. qwen3-8b); default: demo target")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=repeats,
                        help="runs per measurement and side, alternating; medians reported")
    parser.add_argument("--json", help="write the results here")
    return parser


def main():
    parser = decode_arguments(__doc__, repeats=3)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--special-rows", action="store_true",
                        help="only: 16 streams with one penalized / constrained row vs none")
    args = parser.parse_args()
    rows = asyncio.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
