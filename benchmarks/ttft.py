"""Time to first token, side by side in one run: our engine dense and with
SpecPrefill at several keeps, mlx-lm's own `stream_generate` (the dense baseline
users have today), and vllm-mlx 0.6.0's SpecPrefill in its own environment.
Real retrieval prompts from the demo task generator, on the demo pair.

    .venv/bin/python benchmarks/ttft.py --lengths 1024 2048 4096 8192 --runs 3 --json docs/ttft.json

Prints a Markdown table; `benchmarks/plots.py` draws TTFT against prompt length.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx

from specprefill_engine._blas import blas_status
from specprefill_engine.benchmarking import ttft_rows, ttft_table
from specprefill_engine.demo_tasks import make_case
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET, default_dtype, load_model

sys.path.insert(0, str(Path(__file__).parent))
from peers import run_vllm_mlx  # noqa: E402


def vllm_mlx_rows(lengths, keeps, runs, dense: dict, site=None) -> tuple:
    _, tokenizer = load_model()
    cases = [{"ids": tokenizer.apply_chat_template(
        make_case(tokenizer, 0, "passkey", n).messages, add_generation_prompt=True),
        "n_tokens": 1} for n in lengths]
    out = run_vllm_mlx({"target": str(DEMO_TARGET), "draft": str(DEMO_DRAFT), "keeps": keeps,
                        "float32": default_dtype() is not None, "cases": cases,
                        "runs": runs, "warmup": 1}, site)
    if "error" in out:
        return [], out["error"]
    rows = []
    for length, result in zip(lengths, out["results"]):
        for keep in keeps:
            ttft = statistics.median(result[str(keep)]["ttfts"])
            rows.append({"length": length, "method": f"vllm-mlx 0.6.0 keep {keep}", "ttft": ttft,
                         "vs_dense": ttft / dense[length]})
    return rows, ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.2, 0.3])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-peer", action="store_true", help="skip vllm-mlx")
    parser.add_argument("--peer-site", help="folder holding vllm_mlx and mlx_lm 0.31 (no pip)")
    parser.add_argument("--json", help="also write raw rows here")
    args = parser.parse_args(argv)
    rows = ttft_rows(args.lengths, args.keeps, args.runs,
                     report=lambda m: print(m, file=sys.stderr, flush=True))
    peer_error = ""
    if not args.no_peer:
        dense = {r["length"]: r["ttft"] for r in rows if r["method"] == "engine dense"}
        peer_rows, peer_error = vllm_mlx_rows(args.lengths, args.keeps, args.runs, dense,
                                              args.peer_site)
        rows += peer_rows
    rows.sort(key=lambda r: r["length"])
    print(f"device {mx.default_device()}, mlx {mx.__version__}, BLAS: {blas_status()}; "
          f"medians of {args.runs} after a warm-up")
    print(ttft_table(rows))
    if peer_error:
        print(f"\nvllm-mlx 0.6.0 failed: {peer_error}")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "peer_error": peer_error}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
