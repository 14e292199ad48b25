"""What a benchmark row would take on a Mac: its token counts at published mlx-lm rates.

Projected, not measured. The reference is mlx-lm's own benchmark on an M3 Pro (18 GB)
with Qwen3-4B-Instruct-2507 at 4 bits, `mlx_lm.benchmark -p 2048 -g 128`: prompt 615.28
tok/s, generation 44.62 tok/s (mlx-lm PR #1569, mlx 0.32.0). Prefill is compute bound:
a model's prefill of L tokens after C cached takes its FLOPs (`engine/policy.py`'s
`Shape.flops`: weights and attention) at the FLOP rate that benchmark implies. Decode is
bandwidth bound: a token takes the reference's seconds per token scaled by the weights'
size. The same M3 Pro's prefill is ~14x slower than its decode per token (the H200's
~170x), which is why agent turns look so different there. Cross-check: mlx-lm PR #406,
M4 Max, 2048-token prompts at 4 bits: Qwen3 0.6B 10,279 tok/s, Qwen3 30B-A3B 1,732.
"""

from specprefill_engine.engine.policy import Shape

REFERENCE = "M3 Pro, mlx-lm PR #1569 (Qwen3-4B 4-bit: 615.28 prompt / 44.62 generation tok/s)"
_QWEN3_4B = Shape(parameters=3_600_000_000, attention=36 * 32 * 128)  # outside the embedding
_PROMPT_TOK_S, _DECODE_TOK_S, _PROMPT = 615.28, 44.62, 2048
_FLOP_S = _PROMPT_TOK_S * sum(_QWEN3_4B.flops(_PROMPT, 0)) / _PROMPT


def prefill_s(shape: Shape, tokens: int, cached: int = 0) -> float:
    return sum(shape.flops(tokens, cached)) / _FLOP_S if tokens > 0 else 0.0


def decode_s(shape: Shape, tokens: int) -> float:
    return tokens * shape.parameters / (_QWEN3_4B.parameters * _DECODE_TOK_S)


def turn_s(target: Shape, draft: Shape, row: dict) -> dict:
    """A turn's projected seconds from its counts: `draft_tokens` after `draft_cached`,
    `target_tokens` after `target_cached`, `reply_tokens` decoded."""
    scoring = prefill_s(draft, row.get("draft_tokens", 0), row.get("draft_cached", 0))
    prefill = prefill_s(target, row["target_tokens"], row.get("target_cached", 0))
    decode = decode_s(target, row.get("reply_tokens", 0))
    return {"ttft": scoring + prefill, "decode": decode, "wall": scoring + prefill + decode}


def ttft_rows(target: Shape, draft: Shape, lengths, keeps, kept=None) -> list:
    """Projected first-token seconds of one prompt: dense, and SpecPrefill at each keep
    (the draft's prefill of the whole prompt, then the target's of the kept tokens;
    `kept[(length, keep)]` where a run measured it, else keep * length)."""
    rows = []
    for length in lengths:
        dense = prefill_s(target, length)
        rows.append({"length": length, "method": "dense", "ttft": dense})
        for keep in keeps:
            count = (kept or {}).get((length, keep), round(keep * length))
            ttft = turn_s(target, draft, {"draft_tokens": length, "target_tokens": count})["ttft"]
            rows.append({"length": length, "method": f"keep {keep}", "kept": count,
                         "ttft": ttft, "speedup": dense / ttft})
    return rows


def main(argv=None) -> int:
    import argparse
    import json

    from mlx_lm import load

    from specprefill_engine.engine.policy import shape_of

    parser = argparse.ArgumentParser(description="A prompt's TTFT on a Mac, projected from "
                                                 "the two models' shapes (" + REFERENCE + ")")
    parser.add_argument("--target", required=True, help="target model folder")
    parser.add_argument("--draft", required=True, help="draft model folder")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--keeps", type=float, nargs="+", default=[0.1, 0.3])
    parser.add_argument("--ttft-json", help="a gpu_ttft.py run: take its kept counts")
    args = parser.parse_args(argv)
    target, draft = (shape_of(load(path, lazy=True)[0]) for path in (args.target, args.draft))
    kept = {}
    if args.ttft_json:
        for row in json.loads(open(args.ttft_json).read())["rows"]:
            if "kept" in row and "keep" in row:
                kept[(row["length"], row["keep"])] = row["kept"]
    print(f"projected, not measured: {REFERENCE}")
    print("| tokens | dense | " + " | ".join(f"keep {k}" for k in args.keeps) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in args.keeps) + " |")
    rows = ttft_rows(target, draft, args.lengths, args.keeps, kept)
    for length in args.lengths:
        mine = [r for r in rows if r["length"] == length]
        cells = [f"{r['ttft']:.2f} s ({r['speedup']:.2f}x)" for r in mine[1:]]
        print(f"| {length // 1024}K | {mine[0]['ttft']:.2f} s | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
