"""Measurements behind `benchmarks/` and the `bench` / `eval` commands.

TTFT: the engine dense and with SpecPrefill, side by side in one process with
mlx-lm's own `stream_generate`, on demo retrieval prompts. Quality: exact-answer
accuracy of dense prefill, SpecPrefill at several keeps, and a random selection of
the same size (the control that shows the task needs the right tokens).
"""

import math
import random
import statistics
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm import stream_generate

from .core import score_tokens, select_chunks
from .core.answers import dense_answer, sparse_answer
from .core.selection import CHUNK_SIZE, TAIL_TOKENS, effective_chunk_size, forced_tokens
from .demo_tasks import KINDS, make_case
from .engine import Engine
from .engine.blank_lines import BlankLines
from .engine.results import Progress
from .loading import DEMO_DRAFT, load_model

Report = Optional[Callable[[str], None]]


# time to first token ------------------------------------------------------------

def _mlx_lm_ttft(model, tokenizer, ids) -> float:
    started = time.perf_counter()
    for _ in stream_generate(model, tokenizer, ids, max_tokens=1):
        break
    return time.perf_counter() - started


def _engine_row(engine: Engine, messages, runs: int, **options) -> dict:
    engine.generate_sync(messages, max_tokens=2, **options)  # warm-up
    results = []
    for _ in range(runs):
        mx.reset_peak_memory()
        result = engine.generate_sync(messages, max_tokens=32, **options)
        results.append((result, mx.get_peak_memory()))
    ttft = statistics.median(r.timings.time_to_first_token for r, _ in results)
    return {
        "ttft": ttft,
        "scoring_share": statistics.median(r.timings.scoring for r, _ in results) / ttft,
        "decode_tps": statistics.median(r.timings.decode_tokens_per_s for r, _ in results),
        "peak_gb": max(p for _, p in results) / 1e9,
        "kept": results[0][0].specprefill.kept_tokens,
    }


def ttft_rows(lengths, keeps, runs: int = 3, report: Report = None) -> list:
    """One row per (prompt length, method); medians of `runs` after a warm-up."""
    rows = []
    with Engine(prefix_cache_bytes=0) as engine:  # every run prefills from scratch
        for length in lengths:
            messages = make_case(engine.tokenizer, 0, "passkey", length).messages
            rows.append({"length": length, "method": "engine dense",
                         **_engine_row(engine, messages, runs, specprefill=False)})
            for keep in keeps:
                rows.append({"length": length, "method": f"engine SpecPrefill keep {keep}",
                             "keep": keep,
                             **_engine_row(engine, messages, runs, specprefill=True, keep=keep)})
            if report:
                report(f"engine: {length} tokens done")
    model, tokenizer = load_model()
    draft, _ = load_model(default=DEMO_DRAFT)
    ratios = {}
    for length in lengths:
        ids = tokenizer.apply_chat_template(
            make_case(tokenizer, 0, "passkey", length).messages, add_generation_prompt=True)
        _mlx_lm_ttft(model, tokenizer, ids)
        baseline = statistics.median(_mlx_lm_ttft(model, tokenizer, ids) for _ in range(runs))
        draft_time = statistics.median(_mlx_lm_ttft(draft, tokenizer, ids) for _ in range(runs))
        ratios[length] = draft_time / baseline
        rows.append({"length": length, "method": "mlx-lm stream_generate", "ttft": baseline})
        if report:
            report(f"mlx-lm: {length} tokens done")
    add_ratios(rows, ratios)
    return rows


def add_ratios(rows: list, draft_ratio: dict) -> None:
    """TTFT relative to our dense row, and the linear-cost ideal 1/(r + keep)."""
    dense = {r["length"]: r["ttft"] for r in rows if r["method"] == "engine dense"}
    for row in rows:
        row["vs_dense"] = row["ttft"] / dense[row["length"]]
        if "keep" in row:
            row["ideal_speedup"] = 1 / (draft_ratio[row["length"]] + row["keep"])


def ttft_table(rows: list) -> str:
    def cell(row, key, fmt):
        return format(row[key], fmt) if key in row else ""

    lines = ["| tokens | method | TTFT s | speedup vs dense | ideal 1/(r+k) | scoring share "
             "| decode tok/s | peak GB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['method']} | {r['ttft']:.2f} | {1 / r['vs_dense']:.2f}x | "
            f"{cell(r, 'ideal_speedup', '.2f') + ('x' if 'ideal_speedup' in r else '')} | "
            f"{cell(r, 'scoring_share', '.0%')} | "
            f"{cell(r, 'decode_tps', '.1f')} | {cell(r, 'peak_gb', '.2f')} |")
    return "\n".join(lines)


# answer quality -----------------------------------------------------------------

def answer_text(tokenizer, tokens) -> str:
    return tokenizer.decode(tokens).split("<|end|>")[0].strip()


def random_selection(rng: random.Random, length: int, n_kept: int,
                     chunk_size: int = CHUNK_SIZE, tail_tokens: int = TAIL_TOKENS,
                     keep_pct: Optional[float] = None) -> np.ndarray:
    """The same forced sink and tail as `select_chunks`, then random chunks (of the chunk
    size `select_chunks` uses at `keep_pct`, else `chunk_size`) up to `n_kept` tokens:
    the control that shows the task needs the right tokens."""
    _, forced = forced_tokens(length, chunk_size, tail_tokens=tail_tokens)
    size = chunk_size
    if keep_pct is not None:
        size = effective_chunk_size(max(math.ceil(keep_pct * length) - int(forced.sum()), 0),
                                    chunk_size)
    kept = forced.copy()
    chunks = [c for c in range(-(-length // size)) if not kept[c * size:(c + 1) * size].all()]
    rng.shuffle(chunks)
    for c in chunks:
        if kept.sum() >= n_kept:
            break
        kept[c * size:(c + 1) * size] = True
    return np.flatnonzero(kept)


def quality_cases(tokenizer, kinds, lengths, n_cases: int, seed: int = 0) -> list:
    """The case grid: (kind, length, case seed, prompt ids, expected answer)."""
    cases = []
    for length in lengths:
        for kind in kinds:
            for i in range(n_cases):
                case = make_case(tokenizer, seed * 100_000 + i, kind, length)
                ids = tokenizer.apply_chat_template(case.messages, add_generation_prompt=True)
                cases.append({"kind": kind, "length": length, "seed": seed * 100_000 + i,
                              "ids": ids, "answer": case.answer})
    return cases


def quality_rows(cases: list, keeps, random_control: bool = True, report: Report = None,
                 configs: Optional[dict] = None,
                 on_progress: Optional[Callable[[Progress], None]] = None, **scoring) -> list:
    """Per case: whether dense, SpecPrefill at each keep, and random selection answer right.

    `scoring` goes to `score_tokens` (n_lookahead, n_window, ...). `configs`, when given,
    maps a column name to (score_tokens kwargs, select_chunks kwargs); the first one is
    named `specprefill` and sets the random control's sizes, all share the dense answer.
    `on_progress` gets Progress("eval", prompt tokens done, in all) after each case."""
    configs = configs or {"specprefill": (scoring, {})}
    model, tokenizer = load_model()
    draft, _ = load_model(default=DEMO_DRAFT)
    eos = set(tokenizer.eos_token_ids)
    blank_lines = BlankLines(tokenizer)  # the engine's units
    rng = random.Random(0)
    rows = []
    total, done = sum(len(case["ids"]) for case in cases), 0
    for number, case in enumerate(cases, 1):
        ids, answer = case["ids"], case["answer"]
        n = len(answer) + 1

        def right(tokens):
            return answer_text(tokenizer, tokens) == answer

        row = {k: case[k] for k in ("kind", "length", "seed")}
        row["dense"] = right(dense_answer(model, ids, n, eos))
        scores = {}
        for index, (name, (score_kwargs, select_kwargs)) in enumerate(configs.items()):
            key = tuple(sorted(score_kwargs.items()))
            if key not in scores:
                scores[key] = score_tokens(draft, ids, **score_kwargs)
            for keep in keeps:
                kept = select_chunks(scores[key], keep, starts=blank_lines(ids), **select_kwargs)
                row[f"{name}@{keep}"] = right(sparse_answer(model, ids, kept, n, eos))
                if random_control and index == 0:
                    control = random_selection(rng, len(ids), int(kept.size), keep_pct=keep)
                    row[f"random@{keep}"] = right(sparse_answer(model, ids, control, n, eos))
        rows.append(row)
        done += len(ids)
        if on_progress:
            on_progress(Progress("eval", done, total))
        if report and number % 10 == 0:
            report(f"quality: {number}/{len(cases)} cases")
    return rows


def quality_table(rows: list) -> str:
    """Accuracy per (length, method) and accuracy retained relative to dense."""
    methods = [k for k in rows[0] if k not in ("kind", "length", "seed")]
    lines = ["| tokens | n | " + " | ".join(methods) + " |",
             "| --- | --- | " + " | ".join("---" for _ in methods) + " |"]
    for length in sorted({r["length"] for r in rows}):
        group = [r for r in rows if r["length"] == length]
        dense = sum(r["dense"] for r in group)
        cells = []
        for method in methods:
            right = sum(bool(r.get(method)) for r in group)
            retained = f" ({right / dense:.0%} of dense)" if dense and method != "dense" else ""
            cells.append(f"{right / len(group):.0%}{retained}")
        lines.append(f"| {length} | {len(group)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


__all__ = ["KINDS", "answer_text", "dense_answer", "sparse_answer", "quality_cases", "quality_rows", "quality_table", "ttft_rows",
           "ttft_table"]
