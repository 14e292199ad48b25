"""Answer quality: exact-answer accuracy on RULER-style retrieval tasks in the demo
pair's formats (passkey, multi-key assignment with distractors, registry lookup,
two-hop), for dense prefill, our SpecPrefill, a random selection of the same size,
and vllm-mlx 0.6.0's SpecPrefill. Accuracy retained = sparse / dense.

    .venv/bin/python benchmarks/quality.py                      # a small grid, minutes on a CPU
    python benchmarks/quality.py --lengths 1024 2048 4096 --cases 25 --json docs/quality-gpu.json

Prints a Markdown table; `benchmarks/plots.py` draws accuracy against keep.
"""

import argparse
import json
import sys
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx

from specprefill_engine.benchmarking import (
    KINDS, answer_text, quality_cases, quality_rows, quality_table,
)
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET, default_dtype, load_model

sys.path.insert(0, str(Path(__file__).parent))
from peers import run_vllm_mlx  # noqa: E402


def add_vllm_mlx(rows: list, cases: list, keeps, site=None) -> dict:
    """Score vllm-mlx on the same cases; returns what it reported (or its error)."""
    job = {"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT), "keeps": list(keeps),
           "float32": default_dtype() is not None,
           "cases": [{"ids": c["ids"], "n_tokens": len(c["answer"]) + 1} for c in cases]}
    out = run_vllm_mlx(job, site)
    if "error" in out:
        return out
    _, tokenizer = load_model()
    for row, case, result in zip(rows, cases, out.pop("results")):
        for keep in keeps:
            tokens = result[str(keep)]["tokens"]
            row[f"vllm-mlx@{keep}"] = answer_text(tokenizer, tokens) == case["answer"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--cases", type=int, default=5,
                        help="cases per (length, kind); the defaults take minutes on a CPU")
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--lookahead", type=int, default=None, help="score_tokens n_lookahead")
    parser.add_argument("--window", type=int, default=None, help="score_tokens n_window")
    parser.add_argument("--config", action="append", default=[],
                        help="NAME:LOOKAHEAD:WINDOW:MIN_CHUNK:SINK:MIN_FREE_CHUNKS, a column "
                             "per config (the first is `specprefill`, with the random control)")
    parser.add_argument("--no-peer", action="store_true", help="skip vllm-mlx")
    parser.add_argument("--peer-site", help="folder holding vllm_mlx and mlx_lm 0.31 (no pip)")
    parser.add_argument("--json", help="write the per-case rows here")
    args = parser.parse_args(argv)

    _, tokenizer = load_model()
    rows, peer = [], {}
    for length in args.lengths:  # one length at a time, saved as it completes
        cases = quality_cases(tokenizer, args.kinds, [length], args.cases)
        scoring = {k: v for k, v in (("n_lookahead", args.lookahead), ("n_window", args.window))
                   if v is not None}
        configs = None
        if args.config:
            configs = {}
            for number, spec in enumerate(args.config):
                name, look, window, min_chunk, sink, min_free = spec.split(":")
                configs["specprefill" if number == 0 else name] = (
                    {"n_lookahead": int(look), "n_window": int(window)},
                    {"min_chunk_size": int(min_chunk), "sink_tokens": int(sink),
                     "min_free_chunks": int(min_free)})
            print(f"configs: {configs}", file=sys.stderr, flush=True)
        length_rows = quality_rows(cases, args.keeps,
                                   report=lambda m: print(m, file=sys.stderr, flush=True),
                                   configs=configs, **scoring)
        if not args.no_peer and "error" not in peer:
            peer = add_vllm_mlx(length_rows, cases, args.keeps, args.peer_site)
        rows += length_rows
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "peer": peer}, indent=1))
        print(f"{length} tokens done", file=sys.stderr, flush=True)
    print(f"device {mx.default_device()}, mlx {mx.__version__}; {args.cases} cases per length "
          f"and kind ({len(args.kinds)} kinds); scoring "
          f"n_lookahead={args.lookahead or 'default'}, n_window={args.window or 'default'}")
    print(quality_table(rows))
    if "error" in peer:
        print(f"\nvllm-mlx 0.6.0 failed: {peer['error']}")
    elif peer:
        print(f"\nvllm-mlx 0.6.0 (mlx-lm {peer['mlx_lm']}): layer-0 keys after its sparse "
              f"prefill differ from dense keys at the kept indices by up to "
              f"{peer['position_error']:.3g} (ours: <= 1e-4, tests/test_positions.py)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
