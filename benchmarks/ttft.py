"""Time to first token, side by side in one run: our engine dense and with
SpecPrefill at several keeps, and mlx-lm's own `stream_generate` (the dense
baseline users have today). Real retrieval prompts from the demo task generator.

    .venv/bin/python benchmarks/ttft.py --lengths 1024 2048 4096 8192 --runs 3

Prints a Markdown table; `--json PATH` also writes the raw numbers.
"""

import argparse
import json
import statistics
import sys
import time

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm import stream_generate

from specprefill_engine import Engine, load_model
from specprefill_engine.demo_tasks import make_case


def mlx_lm_ttft(model, tokenizer, ids) -> float:
    started = time.perf_counter()
    for _ in stream_generate(model, tokenizer, ids, max_tokens=1):
        break
    return time.perf_counter() - started


def engine_row(engine, messages, runs, **options) -> dict:
    engine.generate_sync(messages, max_tokens=2, **options)  # warm-up
    results = []
    for _ in range(runs):
        mx.reset_peak_memory()
        result = engine.generate_sync(messages, max_tokens=32, **options)
        results.append((result, mx.get_peak_memory()))
    ttft = statistics.median(r.timings.time_to_first_token for r, _ in results)
    scoring = statistics.median(r.timings.scoring for r, _ in results)
    return {
        "ttft": ttft,
        "scoring_share": scoring / ttft if ttft else 0.0,
        "decode_tps": statistics.median(r.timings.decode_tokens_per_s for r, _ in results),
        "peak_gb": max(p for _, p in results) / 1e9,
        "kept": results[0][0].specprefill.kept_tokens,
    }


def run(lengths, keeps, runs) -> list:
    rows = []
    # prefix cache off: every run must prefill from scratch
    with Engine(prefix_cache_bytes=0) as engine:
        for length in lengths:
            messages = make_case(engine.tokenizer, 0, "passkey", length).messages
            dense = engine_row(engine, messages, runs, specprefill=False)
            rows.append({"length": length, "method": "engine dense", **dense})
            for keep in keeps:
                row = engine_row(engine, messages, runs, specprefill=True, keep=keep)
                rows.append({"length": length, "method": f"engine SpecPrefill keep {keep}", **row})
            print(f"{length} tokens done", file=sys.stderr)
    # mlx-lm baseline and the draft/target prefill ratio r, on this thread
    model, tokenizer = load_model()
    draft, _ = load_model(default=specprefill_engine.loading.DEMO_DRAFT)
    for length in lengths:
        ids = tokenizer.apply_chat_template(
            make_case(tokenizer, 0, "passkey", length).messages, add_generation_prompt=True)
        mlx_lm_ttft(model, tokenizer, ids)
        baseline = statistics.median(mlx_lm_ttft(model, tokenizer, ids) for _ in range(runs))
        draft_time = statistics.median(mlx_lm_ttft(draft, tokenizer, ids) for _ in range(runs))
        rows.append({"length": length, "method": "mlx-lm stream_generate", "ttft": baseline,
                     "draft_ratio": draft_time / baseline})
    for row in rows:
        dense = next(r for r in rows if r["length"] == row["length"] and r["method"] == "engine dense")
        ratio = next(r["draft_ratio"] for r in rows if r["length"] == row["length"] and "draft_ratio" in r)
        row["vs_dense"] = row["ttft"] / dense["ttft"]
        if "keep" in row["method"]:
            keep = float(row["method"].split()[-1])
            row["ideal_speedup"] = 1 / (ratio + keep)
    return rows


def table(rows) -> str:
    lines = ["| tokens | method | TTFT s | / dense | speedup | ideal 1/(r+k) | scoring share | decode tok/s | peak GB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['method']} | {r['ttft']:.2f} | {r['vs_dense']:.2f} | "
            f"{1 / r['vs_dense']:.2f}x | {r.get('ideal_speedup', float('nan')):.2f}x | "
            f"{r.get('scoring_share', float('nan')):.0%} | {r.get('decode_tps', float('nan')):.1f} | "
            f"{r.get('peak_gb', float('nan')):.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="also write raw rows here")
    args = parser.parse_args(argv)
    rows = run(args.lengths, args.keeps, args.runs)
    print(f"machine: {mx.default_device()}, mlx {mx.__version__}, "
          f"BLAS: {specprefill_engine._blas.blas_status()}")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
