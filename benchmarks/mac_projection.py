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
