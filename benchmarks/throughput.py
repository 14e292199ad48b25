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

With `--speculative K...`: speculative decoding with the SpecPrefill draft, one stream,
greedy: mlx-lm's `speculative_generate_step` (the draft proposes K tokens, the target
verifies them in one forward) against `generate_step`, on code answers ("write a function
...") and tool calls (the first reply of `tool_agent.py`'s task, through the model's chat
template with its tools), the sides alternating per prompt; or, with `--engine`, the
engine's own `num_draft_tokens` against its plain decoding (the draft also computes a
dense prompt's KV first: the TTFT column shows that cost). Per kind and K: decode
tokens/s, the share of tokens taken from the draft, tokens per target forward, whether
every reply equals plain decoding's, and a Mac projection of the speed-up (common.py:
decode bound by the weights' bytes; projected, not measured). With `--shape`, random
weights' proposals are all but never taken: that measures what a round costs.

    python benchmarks/throughput.py                       # CPU, demo target
    python benchmarks/throughput.py --shape qwen3-8b --json out.json  # GPU, random weights
    python benchmarks/throughput.py --special-rows --streams 16 --repeats 5
    python benchmarks/throughput.py --model T --draft D --speculative 2 3 --engine
"""

import argparse
import asyncio
import importlib.util
import json
import statistics
import time
from typing import Optional

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step

from mlx_lm.generate import speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine import Engine
from specprefill_engine.engine.policy import shape_of
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET, load_model

from common import (
    MAC_REFERENCE, add_model_arguments, add_run_arguments, mac_decode_s, model_folders,
    write_json,
)
from tool_agent import ASK, TOOLS, make_task


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
    batch = prompts(16, args.lengths[0], vocab, 16)
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
    path, _ = model_folders(args)
    vocab = 4000
    rows = []
    # at least 2: the stall measurement decodes one stream while another request prefills;
    # the special rows run 16 streams
    batch_size = max(*args.streams, 16 if args.special_rows else 2)
    async with Engine(model=path, draft=None, max_batch_size=batch_size) as engine:
        warm = prompts(2, args.lengths[0], vocab, 99)
        await engine_run(engine, warm, 8)
        if args.special_rows:
            return await special_rows(engine, args, vocab)
        model, _ = load_model(path) if path else load_model()
        mlx_lm_batch_run(model, warm, 8)
        for n in args.streams:
            batch = prompts(n, args.lengths[0], vocab, n)
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


CODE = [
    "Write a Python function `merge_intervals(intervals)` that merges overlapping "
    "intervals given as (start, end) tuples and returns them sorted.",
    "Write a Python class `LRUCache` with `get(key)` and `put(key, value)` in O(1), "
    "using `collections.OrderedDict`.",
    "Write a Python function that parses a line of a CSV file with quoted fields "
    "(commas inside quotes) without the csv module.",
    "Write an asyncio function `fetch_all(urls, limit)` that downloads the URLs with "
    "aiohttp, at most `limit` at a time, and returns the bodies in order.",
    "Write a Python function `topological_sort(graph)` for a dict of node -> list of "
    "dependencies; raise ValueError on a cycle.",
    "Write a pytest test module for a function `slugify(text)` that lowercases, strips "
    "accents and joins words with hyphens.",
    "Write a Python dataclass `Money` with currency and amount (Decimal), addition that "
    "refuses mixed currencies, and a `__str__`.",
    "Write a Python function that reads a large log file line by line and returns the "
    "ten most frequent IP addresses.",
]


def reply_prompts(tokenizer, kind: str, count: int) -> list:
    if kind == "code":
        return [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True)
                for text in (CODE * (count // len(CODE) + 1))[:count]]
    out = []
    for index in range(count):
        task = make_task(tokenizer, seed=7, index=index, n_tokens=600, n_files=3)
        messages = [{"role": "user", "content": ASK + task.questions[0][0]}]
        out.append(tokenizer.apply_chat_template(messages, tools=TOOLS,
                                                 add_generation_prompt=True))
    return out


def decode(steps, tokens: int) -> dict:
    """Run a generator of mlx-lm steps; time from the first token to the last."""
    out, drafted, first = [], [], None
    for step in steps:
        token, from_draft = step[0], step[2] if len(step) > 2 else False
        if first is None:
            first = time.perf_counter()
        out.append(int(token))
        drafted.append(bool(from_draft))
        if len(out) >= tokens:
            break
    seconds = time.perf_counter() - first
    return {"tokens": out, "drafted": drafted, "tok_s": (len(out) - 1) / max(seconds, 1e-9)}


def plain(model, prompt: list, tokens: int) -> dict:
    cache = make_prompt_cache(model)
    return decode(generate_step(mx.array(prompt), model, prompt_cache=cache,
                                max_tokens=tokens), tokens)


def speculative(model, draft, prompt: list, tokens: int, k: int) -> dict:
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    return decode(speculative_generate_step(mx.array(prompt), model, draft, prompt_cache=cache,
                                            num_draft_tokens=k, max_tokens=tokens), tokens)


def projected_speedup(target, draft, row: dict, k: int) -> float:
    """Plain decode over speculative decode of the same tokens on a Mac, projected: each
    round is k draft tokens and one target forward (a forward of k + 1 tokens reads the
    weights once, as one token does)."""
    n = len(row["tokens"])
    rounds = n - sum(row["drafted"])  # each round ends with the target's own token
    return (mac_decode_s(target, n)
            / (rounds * (mac_decode_s(draft, k) + mac_decode_s(target, 1))))


def engine_rows(args, tokenizer=None) -> list:
    """Each prompt through one engine, plain then with each draft length, greedy."""
    from specprefill_engine import Engine

    rows = []
    with Engine(model=args.target, draft=args.draft, densify="off") as engine:
        tokenizer = engine.tokenizer
        options = dict(max_tokens=args.new_tokens, ignore_eos=True, specprefill=False,
                       cache_prompt=False)
        warm = reply_prompts(tokenizer, "code", 1)[0]
        for k in [0, *args.speculative]:
            engine.generate_sync(warm, max_tokens=8, num_draft_tokens=k, **{
                key: value for key, value in options.items() if key != "max_tokens"})
        for repeat in range(args.repeats):
            for kind in args.kinds:
                for index, prompt in enumerate(reply_prompts(tokenizer, kind, args.prompts)):
                    reference = engine.generate_sync(prompt, num_draft_tokens=0, **options)
                    rows.append({"kind": kind, "prompt": index, "repeat": repeat, "k": 0,
                                 "tok_s": reference.timings.decode_tokens_per_s,
                                 "ttft": reference.timings.time_to_first_token})
                    print(json.dumps(rows[-1]), flush=True)
                    for k in args.speculative:
                        run = engine.generate_sync(prompt, num_draft_tokens=k, **options)
                        report = run.specprefill
                        rounds = max(report.drafted_tokens // k, 1)
                        rows.append({
                            "kind": kind, "prompt": index, "repeat": repeat, "k": k,
                            "tok_s": run.timings.decode_tokens_per_s,
                            "ttft": run.timings.time_to_first_token,
                            "drafted": report.accepted_tokens / len(run.token_ids),
                            "per_forward": len(run.token_ids) / rounds,
                            "same": run.token_ids == reference.token_ids,
                            "plain_tok_s": reference.timings.decode_tokens_per_s,
                            "plain_ttft": reference.timings.time_to_first_token})
                        print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_table(args, rows: list) -> list:
    table = []
    for kind in args.kinds:
        for k in args.speculative:
            mine = [r for r in rows if r["kind"] == kind and r["k"] == k]
            table.append({
                "kind": kind, "k": k, "runs": len(mine),
                "plain_tok_s": statistics.median(r["plain_tok_s"] for r in mine),
                "speculative_tok_s": statistics.median(r["tok_s"] for r in mine),
                "speedup": statistics.median(r["tok_s"] / r["plain_tok_s"] for r in mine),
                "drafted": statistics.mean(r["drafted"] for r in mine),
                "per_forward": statistics.mean(r["per_forward"] for r in mine),
                "all_same": all(r["same"] for r in mine),
                "ttft_ratio": statistics.median(r["ttft"] / r["plain_ttft"] for r in mine)})
    print("| kind | draft tokens | plain tok/s | speculative tok/s | speed-up | from the draft "
          "| tokens per target forward | same tokens | TTFT, speculative / plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in table:
        print(f"| {t['kind']} | {t['k']} | {t['plain_tok_s']:.1f} | {t['speculative_tok_s']:.1f} "
              f"| {t['speedup']:.2f}x | {t['drafted']:.0%} | {t['per_forward']:.2f} "
              f"| {'yes' if t['all_same'] else 'no'} | {t['ttft_ratio']:.2f}x |")
    return table


def speculative_main(args) -> None:
    if args.engine:
        rows = engine_rows(args)
        table = engine_table(args, rows)
        write_json(args.json, {"rows": rows, "table": table, "args": vars(args)})
        return
    model, tokenizer = load_model(args.target)  # float32 on a CPU, as the engine runs it
    draft, _ = load_model(args.draft)
    shapes = shape_of(model), shape_of(draft)
    plain(model, reply_prompts(tokenizer, "code", 1)[0], 8)  # warm up both paths
    speculative(model, draft, reply_prompts(tokenizer, "code", 1)[0], 8, args.speculative[0])
    rows = []
    for repeat in range(args.repeats):
        for kind in args.kinds:
            for index, prompt in enumerate(reply_prompts(tokenizer, kind, args.prompts)):
                reference = plain(model, prompt, args.new_tokens)
                rows.append({"kind": kind, "prompt": index, "repeat": repeat, "k": 0,
                             "tok_s": reference["tok_s"], "tokens": len(reference["tokens"])})
                for k in args.speculative:
                    run = speculative(model, draft, prompt, args.new_tokens, k)
                    rows.append({
                        "kind": kind, "prompt": index, "repeat": repeat, "k": k,
                        "tok_s": run["tok_s"], "tokens": len(run["tokens"]),
                        "drafted": sum(run["drafted"]) / len(run["drafted"]),
                        "per_forward": len(run["tokens"]) / (len(run["tokens"])
                                                             - sum(run["drafted"])),
                        "same": run["tokens"] == reference["tokens"][: len(run["tokens"])],
                        "mac_projected_speedup": projected_speedup(*shapes, run, k),
                        "plain_tok_s": reference["tok_s"]})
                print(json.dumps(rows[-1]), flush=True)
    table = []
    for kind in args.kinds:
        base = [r["tok_s"] for r in rows if r["kind"] == kind and r["k"] == 0]
        for k in args.speculative:
            mine = [r for r in rows if r["kind"] == kind and r["k"] == k]
            table.append({
                "kind": kind, "k": k, "runs": len(mine),
                "plain_tok_s": statistics.median(base),
                "speculative_tok_s": statistics.median(r["tok_s"] for r in mine),
                "speedup": statistics.median(r["tok_s"] / r["plain_tok_s"] for r in mine),
                "drafted": statistics.mean(r["drafted"] for r in mine),
                "per_forward": statistics.mean(r["per_forward"] for r in mine),
                "all_same": all(r["same"] for r in mine),
                "mac_projected_speedup": statistics.median(r["mac_projected_speedup"]
                                                           for r in mine)})
    print("| kind | draft tokens | plain tok/s | speculative tok/s | speed-up | from the draft "
          "| tokens per target forward | same tokens | Mac, projected |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in table:
        print(f"| {t['kind']} | {t['k']} | {t['plain_tok_s']:.1f} | {t['speculative_tok_s']:.1f} "
              f"| {t['speedup']:.2f}x | {t['drafted']:.0%} | {t['per_forward']:.2f} "
              f"| {'yes' if t['all_same'] else 'no'} | {t['mac_projected_speedup']:.2f}x |")
    write_json(args.json, {"rows": rows, "table": table, "mac_reference": MAC_REFERENCE,
                           "args": vars(args)})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_run_arguments(parser, lengths=[512], repeats=3, one_length=True,
                      what="prompt tokens per stream")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="tokens per request (default: 128; 160 with --speculative)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--long-prompt", type=int, default=8192)
    parser.add_argument("--special-rows", action="store_true",
                        help="only: 16 streams with one penalized / constrained row vs none")
    parser.add_argument("--speculative", type=int, nargs="+", metavar="K",
                        help="only: speculative decoding, K draft tokens a round, against plain")
    parser.add_argument("--kinds", nargs="+", default=["code", "tool"],
                        help="with --speculative: the replies' kinds")
    parser.add_argument("--prompts", type=int, default=8, help="with --speculative: per kind")
    parser.add_argument("--engine", action="store_true",
                        help="with --speculative: the engine's num_draft_tokens, not mlx-lm's")
    args = parser.parse_args(argv)
    if args.speculative:
        args.new_tokens = args.new_tokens or 160
        args.target, args.draft = model_folders(args)
        args.target, args.draft = args.target or str(DEMO_TARGET), args.draft or str(DEMO_DRAFT)
        speculative_main(args)
        return 0
    args.new_tokens = args.new_tokens or 128
    rows = asyncio.run(main_async(args))
    write_json(args.json, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
