"""Memory: one request's peak memory and KV at long context for dense prefill, SpecPrefill
and quantized KV (kv_bits) and their combinations, side by side in one run; prefill and
decode speed with quantized KV against the model's dtype; answers with kv_bits 8 and 4
against dense on the demo pair's quality cases; and, computed from Qwen3 8B's published
shape (labelled as computed), how many 32K-token agent sessions fit in 16 / 32 / 64 GB.

    .venv/bin/python benchmarks/memory.py --target-shape qwen3-narrow --draft-shape tiny \\
        --json docs/results/memory-cpu-demo.json               # this CPU: minutes
    python benchmarks/memory.py --target-shape qwen3-8b --lengths 8192 16384 32768   # a GPU

Peak memory is MLX's allocator's peak during the request over what was allocated before
it (weights, the engine's state), so it counts the KV and what the forwards computed;
`kv_bytes` is what the request's target KV held at its end (the report's). Each request
runs with cache_prompt=False, so no prefix cache holds or serves it.
"""

import argparse
import json
import math
import platform
import sys
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx

from common import random_model_dir  # noqa: E402
from specprefill_engine import Engine, code_tasks, prose_tasks  # noqa: E402
from specprefill_engine.benchmarking import KINDS, answer_text, quality_cases  # noqa: E402
from specprefill_engine.core.quantized_kv import (  # noqa: E402
    KV_GROUP_SIZE, QUANTIZED_KV_START, QuantizedKV, kv_bytes,
)
from specprefill_engine.demo_tasks import make_case  # noqa: E402
from specprefill_engine.engine.memory import HEADROOM  # noqa: E402

# Qwen3-8B's published config (huggingface.co/Qwen/Qwen3-8B, config.json): 36 layers, 8 KV
# heads of 128, bfloat16; 8.19B parameters
QWEN3_8B = dict(layers=36, kv_heads=8, head_dim=128, itemsize=2, parameters=8.19e9)
WEIGHT_BITS = {"4-bit": 4.5, "8-bit": 8.5, "bf16": 16}  # per parameter, with group scales
SESSION_TOKENS = 32768


def settings(keeps, bits) -> list:
    """(keep or None for dense, kv_bits or None) for every combination."""
    return [(keep, kv) for kv in [None, *bits] for keep in [None, *keeps]]


def one_request(engine: Engine, ids: list, keep, max_tokens: int) -> dict:
    mx.synchronize()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    started = time.perf_counter()
    result = engine.generate_sync(ids, max_tokens=max_tokens, ignore_eos=True,
                                  specprefill=keep is not None, keep=keep or 1.0,
                                  cache_prompt=False)
    wall = time.perf_counter() - started
    report, timings = result.specprefill, result.timings
    return {"prompt_tokens": result.usage.prompt_tokens, "kept_tokens": report.kept_tokens,
            "engaged": report.engaged, "peak_bytes": mx.get_peak_memory() - base,
            "kv_bytes": report.kv_bytes, "dense_kv_bytes": report.dense_kv_bytes,
            "draft_kv_bytes": report.draft_kv_bytes, "ttft_s": timings.time_to_first_token,
            "scoring_s": timings.scoring, "prefill_s": timings.prefill,
            "prefill_tokens_per_s": report.kept_tokens / timings.prefill if timings.prefill else 0,
            "decode_tokens_per_s": timings.decode_tokens_per_s, "wall_s": wall}


def peak_rows(args, target, draft) -> list:
    """Every (length, keep, kv_bits) once, an engine per kv_bits."""
    rows = []
    for kv in [None, *args.kv_bits]:
        with Engine(model=target, draft=draft, kv_bits=kv, kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quantized_kv_start, densify="off") as engine:
            for length in args.lengths:
                ids = engine.tokenizer.apply_chat_template(
                    make_case(engine.tokenizer, 0, "passkey", length).messages,
                    add_generation_prompt=True)
                for keep in [None, *args.keeps]:
                    row = {"length": length, "keep": keep, "kv_bits": kv,
                           **one_request(engine, ids, keep, args.max_tokens)}
                    rows.append(row)
                    print(f"{length:>6} keep {keep or 'dense':>5} kv_bits {kv or '-':>2}: peak "
                          f"{row['peak_bytes'] / 1e6:8.1f} MB, KV {row['kv_bytes'] / 1e6:7.1f} MB"
                          f" (dense {row['dense_kv_bytes'] / 1e6:.1f}), draft "
                          f"{row['draft_kv_bytes'] / 1e6:.1f} MB, prefill "
                          f"{row['prefill_tokens_per_s']:.0f} tok/s, decode "
                          f"{row['decode_tokens_per_s']:.1f} tok/s", flush=True)
    return rows


def speed_rows(rows: list) -> list:
    """Dense rows' prefill and decode speed at each kv_bits over the model's dtype's."""
    out = []
    for row in rows:
        if row["keep"] is not None or row["kv_bits"] is None:
            continue
        base = next(r for r in rows if r["length"] == row["length"] and r["keep"] is None
                    and r["kv_bits"] is None)
        out.append({"length": row["length"], "kv_bits": row["kv_bits"],
                    "prefill_vs_dtype": row["prefill_tokens_per_s"] / base["prefill_tokens_per_s"],
                    "decode_vs_dtype": row["decode_tokens_per_s"] / base["decode_tokens_per_s"]})
    return out


def model_cases(tokenizer, lengths, count: int) -> list:
    """A real model's cases: passkeys in prose and "which number does `f` add" in Python,
    each with its own check of the reply."""
    cases = []
    for length in lengths:
        for seed in range(count):
            for kind, case in (("passkey", prose_tasks.make_case(tokenizer, "passkey", length, seed)),
                               ("code_return", code_tasks.make_case(tokenizer, "code_return",
                                                                    length, seed, seed))):
                module = prose_tasks if kind == "passkey" else code_tasks
                cases.append({"kind": kind, "length": length, "seed": seed, "ids": case.ids,
                              "max_tokens": case.max_tokens,
                              "right": lambda text, c=case, m=module: m.is_right(c, text)})
    return cases


def quality(args) -> dict:
    """Greedy answers, dense prefill, with each kv_bits against the model's dtype: which
    of dense's right answers are kept. The demo pair's cases, or `--quality-model`'s."""
    rows, answers = [], {}
    model = {} if args.quality_model is None else {"model": args.quality_model, "draft": None}
    for kv in [None, *args.kv_bits]:
        with Engine(kv_bits=kv, kv_group_size=args.kv_group_size,
                    quantized_kv_start=args.quality_kv_start, densify="off", **model) as engine:
            tokenizer = engine.tokenizer
            if args.quality_model is None:
                cases = quality_cases(tokenizer, KINDS, args.quality_lengths, args.quality_cases)
                for case in cases:
                    case["max_tokens"] = len(case["answer"]) + 1
                    case["right"] = lambda text, a=case["answer"]: text == a
            else:
                cases = model_cases(tokenizer, args.quality_lengths, args.quality_cases)
            for i, case in enumerate(cases):
                result = engine.generate_sync(case["ids"], max_tokens=case["max_tokens"],
                                              specprefill=False, cache_prompt=False)
                text = answer_text(tokenizer, result.token_ids) if args.quality_model is None \
                    else result.text
                answers[i, kv] = case["right"](text)
    for i, case in enumerate(cases):
        rows.append({"kind": case["kind"], "length": case["length"], "seed": case["seed"],
                     **{f"kv_bits={kv}": answers[i, kv] for kv in [None, *args.kv_bits]}})
    dense = [r for r in rows if r["kv_bits=None"]]
    summary = {"cases": len(rows), "dense_right": len(dense)}
    for kv in args.kv_bits:
        summary[f"kv_bits={kv}_right"] = sum(r[f"kv_bits={kv}"] for r in rows)
        summary[f"kv_bits={kv}_kept_of_dense"] = sum(r[f"kv_bits={kv}"] for r in dense)
    return {"quantized_kv_start": args.quality_kv_start, "summary": summary, "rows": rows}


def sessions(args) -> list:
    """Computed, not measured: 32K-token agent sessions of Qwen3 8B (published shape) that
    fit the engine's default budget on a Mac of 16 / 32 / 64 GB: Metal's recommended
    working set (assumed `--working-set-share` of the memory) less the engine's headroom
    and the weights, over one session's target KV (the draft's while one scores, and the
    reply's, left out)."""
    shape = QWEN3_8B
    rate = 2 * shape["layers"] * shape["kv_heads"] * shape["head_dim"] * shape["itemsize"]
    rows = []
    for gb in (16, 32, 64):
        for weights_label, bits in WEIGHT_BITS.items():
            weights = shape["parameters"] * bits / 8
            budget = gb * 1e9 * args.working_set_share * (1 - HEADROOM) - weights
            for keep, kv_bits in settings(args.keeps, args.kv_bits):
                for start in sorted({args.quantized_kv_start, 0, QUANTIZED_KV_START}) if kv_bits \
                        else [None]:
                    entries = math.ceil(SESSION_TOKENS * (keep or 1.0))
                    kv = QuantizedKV(kv_bits, args.kv_group_size, start) if kv_bits else None
                    per = kv_bytes(rate, entries, kv, shape["itemsize"])
                    rows.append({"memory_gb": gb, "weights": weights_label,
                                 "keep": keep, "kv_bits": kv_bits, "quantized_kv_start": start,
                                 "session_kv_gb": per / 1e9, "budget_gb": budget / 1e9,
                                 "sessions": max(int(budget // per), 0)})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-shape", help="a random-weight target (random_models.py; "
                        "e.g. qwen3-narrow on a CPU, qwen3-8b on a GPU); default: the demo "
                        "target (a context of 16K)")
    parser.add_argument("--draft-shape", default="tiny", help="the random draft's shape")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--keeps", type=float, nargs="*", default=[0.3, 0.1])
    parser.add_argument("--kv-bits", type=int, nargs="+", default=[8, 4], choices=[4, 8])
    parser.add_argument("--kv-group-size", type=int, default=KV_GROUP_SIZE)
    parser.add_argument("--quantized-kv-start", type=int, default=QUANTIZED_KV_START,
                        help=f"the engine's (default {QUANTIZED_KV_START}, mlx-lm's)")
    parser.add_argument("--max-tokens", type=int, default=32, help="reply tokens timed")
    parser.add_argument("--quality-lengths", type=int, nargs="*", default=[1024, 2048],
                        help="the demo pair's quality cases (none: skipped)")
    parser.add_argument("--quality-cases", type=int, default=3, help="per (length, kind)")
    parser.add_argument("--quality-model", help="a real model's folder for the quality cases "
                        "(prose passkeys and Python lookups; default: the demo pair's cases)")
    parser.add_argument("--quality-kv-start", type=int, default=0,
                        help="quantized_kv_start for the quality cases (0: their whole KV "
                        "quantized; at the default 5000 prompts this short never are)")
    parser.add_argument("--working-set-share", type=float, default=0.75,
                        help="Metal's recommended working set as a share of a Mac's memory, "
                        "for the computed sessions")
    parser.add_argument("--skip-peak", action="store_true", help="only quality and sessions")
    parser.add_argument("--json", help="write everything here")
    args = parser.parse_args(argv)
    target = draft = None
    if args.target_shape:
        target, draft = random_model_dir(args.target_shape), random_model_dir(args.draft_shape, 1)
    out = {"command": " ".join(["python", "benchmarks/memory.py", *(argv or sys.argv[1:])]),
           "device": str(mx.default_device()), "machine": platform.machine(),
           "target": args.target_shape or "demo", "draft": args.draft_shape if target else "demo",
           "quantized_kv_start": args.quantized_kv_start, "kv_group_size": args.kv_group_size}
    if not args.skip_peak:
        out["peak"] = peak_rows(args, target, draft)
        out["speed"] = speed_rows(out["peak"])
        for row in out["speed"]:
            print(f"{row['length']:>6} kv_bits {row['kv_bits']}: prefill "
                  f"{row['prefill_vs_dtype']:.2f}x, decode {row['decode_vs_dtype']:.2f}x the "
                  "model's dtype")
    if args.quality_lengths:
        out["quality"] = quality(args)
        print("quality (dense prefill):", out["quality"]["summary"])
    out["sessions_computed"] = sessions(args)
    for row in out["sessions_computed"]:
        if row["weights"] == "4-bit":
            print(f"computed: {row['memory_gb']} GB, 4-bit weights, keep {row['keep'] or 1.0}, "
                  f"kv_bits {row['kv_bits'] or '-'} (start {row['quantized_kv_start']}): "
                  f"{row['session_kv_gb']:.2f} GB a session, {row['sessions']} sessions")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
