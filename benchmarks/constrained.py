"""Cost per token of constrained decoding (`response_format`), on the demo pair.

Two measurements:

1. The processor alone: replay the tokens of a constrained greedy decode through a
   fresh processor and time each call (llguidance's mask on the host + the masked
   `where` on the MLX device, evaluated), at the demo vocabulary (4096) and with the
   logits padded to 151,936 columns (a Qwen-sized vocabulary row; the mask beyond the
   tokenizer stays zero), so the apply cost at a large vocabulary shows.
2. Through the engine: decode ms/token of the same request unconstrained and with
   each format. `regex (?s:.*)` allows every token, so its greedy output equals the
   unconstrained one and the difference is the pure overhead.

    .venv/bin/python benchmarks/constrained.py --tokens 64 --runs 3
"""

import argparse
import json
import statistics
import time

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import generate_step

from specprefill_engine import Engine
from specprefill_engine.engine.constrained import make_constraint

JOKE = {"type": "object", "properties": {"setup": {"type": "string"},
                                         "punchline": {"type": "string"}},
        "required": ["setup", "punchline"]}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather at a location.",
    "parameters": {"type": "object", "properties": {"location": {"type": "string"}},
                   "required": ["location"]}}}]
FORMATS = {
    "none": None,
    "regex (?s:.*)": {"type": "regex", "regex": "(?s:.*)"},
    "json_object": {"type": "json_object"},
    "json_schema": {"type": "json_schema", "json_schema": {"name": "Joke", "schema": JOKE}},
    "tool_call required": {"type": "tool_call", "tools": TOOLS, "tool_choice": "required"},
    "tool_call auto": {"type": "tool_call", "tools": TOOLS, "tool_choice": "auto"},
}
MESSAGES = [{"role": "user", "content": "Tell me a joke about the weather in Paris."}]


def replay_costs(model, tokenizer, response_format, n_tokens: int, vocab: int) -> dict:
    """Per-call processor time (ms) over the tokens of a constrained greedy decode."""
    processor = make_constraint(tokenizer, response_format)
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tools=TOOLS)
    tokens = []
    steps = generate_step(mx.array(ids), model, max_tokens=n_tokens,
                          sampler=lambda lp: mx.argmax(lp, axis=-1),
                          logits_processors=[lambda t, l: processor(t[len(ids):], l)])
    for token, _ in steps:
        if int(token) in tokenizer.eos_token_ids:
            break
        tokens.append(int(token))
    fresh = make_constraint(tokenizer, response_format)
    logits = mx.random.normal((1, vocab))
    mx.eval(logits)
    times = []
    for i in range(len(tokens) + 1):
        started = time.perf_counter()
        mx.eval(fresh(mx.array(tokens[:i], dtype=mx.int32), logits))
        times.append((time.perf_counter() - started) * 1e3)
    return {"tokens": len(tokens), "mean_ms": statistics.mean(times),
            "p95_ms": sorted(times)[int(0.95 * (len(times) - 1))]}


def engine_costs(engine, response_format, n_tokens: int, runs: int) -> dict:
    kwargs = {"max_tokens": n_tokens, "tools": TOOLS}
    if response_format is not None:
        kwargs["response_format"] = response_format
    engine.generate_sync(MESSAGES, **kwargs)  # warm-up (grammar compile paths, caches)
    per_token, lengths = [], []
    for _ in range(runs):
        result = engine.generate_sync(MESSAGES, **kwargs)
        if result.timings.decode_tokens_per_s:
            per_token.append(1e3 / result.timings.decode_tokens_per_s)
        lengths.append(result.usage.completion_tokens)
    return {"ms_per_token": statistics.median(per_token) if per_token else float("nan"),
            "tokens": statistics.median(lengths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    from specprefill_engine.loading import load_model

    model, tokenizer = load_model()
    out = {"device": str(mx.default_device()), "processor": {}, "engine": {}}
    print(f"device: {out['device']}; demo target (vocab {len(tokenizer._tokenizer)})\n")
    print("| format | tokens | processor ms/call, V=4096 (mean / p95) "
          "| processor ms/call, V=151936 (mean / p95) |")
    print("| --- | --- | --- | --- |")
    for name, response_format in FORMATS.items():
        if response_format is None:
            continue
        small = replay_costs(model, tokenizer, response_format, args.tokens, 4096)
        large = replay_costs(model, tokenizer, response_format, args.tokens, 151936)
        out["processor"][name] = {"4096": small, "151936": large}
        print(f"| {name} | {small['tokens']} | {small['mean_ms']:.3f} / {small['p95_ms']:.3f} "
              f"| {large['mean_ms']:.3f} / {large['p95_ms']:.3f} |")

    print("\n| format (engine, greedy) | tokens | decode ms/token | overhead vs none |")
    print("| --- | --- | --- | --- |")
    with Engine() as engine:
        base = None
        for name, response_format in FORMATS.items():
            row = engine_costs(engine, response_format, args.tokens, args.runs)
            out["engine"][name] = row
            base = row["ms_per_token"] if base is None else base
            print(f"| {name} | {row['tokens']:.0f} | {row['ms_per_token']:.2f} "
                  f"| {row['ms_per_token'] - base:+.2f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
