"""Speculative decoding with the SpecPrefill draft: would the draft that scores the prompt
pay for itself again by drafting the reply?

mlx-lm's `speculative_generate_step` (the draft proposes `--draft-tokens` tokens, the
target verifies them in one forward) against `generate_step`, greedy, one stream, the
target and its draft (the real pair), on two kinds of reply: code answers ("write a
function ...") and tool calls (the first reply of `tool_agent.py`'s task, through the
model's chat template with its tools). The sides alternate per prompt and repeat. Per
kind and draft length: decode tokens/s (after the first token), the share of tokens
taken from the draft, tokens per target forward, whether every reply equals plain
decoding's, and a Mac projection of the speed-up from those counts
(`mac_projection.py`: decode bound by the weights' bytes; a verification costs one
target token; projected, not measured).

With `--engine`, the engine's own speculative decoding (`num_draft_tokens`) against its
plain decoding, one engine, the requests alternating (the draft also computes a dense
prompt's KV first: the TTFT column shows that cost; decode tokens/s are the Result's).

    .venv/bin/python benchmarks/speculative.py --target T --draft D --prompts 2 --tokens 48
    python benchmarks/speculative.py --target T --draft D --repeats 12 --json spec-gpu.json
    .venv/bin/python benchmarks/speculative.py --target T --draft D --engine --prompts 3

With random weights (`--target-shape`, e.g. an 8B / 0.6B pair on a GPU) the draft's
proposals are all but never taken, so `--engine` measures what a round costs there
against a plain step: the speed at the real pair's acceptance follows from it.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import generate_step, speculative_generate_step
from mlx_lm.models.cache import make_prompt_cache

from specprefill_engine.engine.policy import shape_of
from specprefill_engine.loading import load_model

import mac_projection
from random_models import add_pair_arguments, random_pair
from tool_agent import ASK, TOOLS, make_task

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


def prompts(tokenizer, kind: str, count: int) -> list:
    if kind == "code":
        return [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                              add_generation_prompt=True)
                for text in (CODE * (count // len(CODE) + 1))[:count]]
    out = []
    for index in range(count):
        task = make_task(tokenizer, seed=7, index=index, n_tokens=600, n_files=3)
        messages = [{"role": "user", "content": ASK + task.question}]
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
    return (mac_projection.decode_s(target, n)
            / (rounds * (mac_projection.decode_s(draft, k) + mac_projection.decode_s(target, 1))))


def engine_rows(args, tokenizer=None) -> list:
    """Each prompt through one engine, plain then with each draft length, greedy."""
    from specprefill_engine import Engine

    rows = []
    with Engine(model=args.target, draft=args.draft, densify="off") as engine:
        tokenizer = engine.tokenizer
        options = dict(max_tokens=args.tokens, ignore_eos=True, specprefill=False,
                       cache_prompt=False)
        warm = prompts(tokenizer, "code", 1)[0]
        for k in [0, *args.draft_tokens]:
            engine.generate_sync(warm, max_tokens=8, num_draft_tokens=k, **{
                key: value for key, value in options.items() if key != "max_tokens"})
        for repeat in range(args.repeats):
            for kind in args.kinds:
                for index, prompt in enumerate(prompts(tokenizer, kind, args.prompts)):
                    reference = engine.generate_sync(prompt, num_draft_tokens=0, **options)
                    rows.append({"kind": kind, "prompt": index, "repeat": repeat, "k": 0,
                                 "tok_s": reference.timings.decode_tokens_per_s,
                                 "ttft": reference.timings.time_to_first_token})
                    print(json.dumps(rows[-1]), flush=True)
                    for k in args.draft_tokens:
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
        for k in args.draft_tokens:
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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target")
    parser.add_argument("--draft")
    add_pair_arguments(parser)
    parser.add_argument("--kinds", nargs="+", default=["code", "tool"])
    parser.add_argument("--prompts", type=int, default=8, help="prompts per kind")
    parser.add_argument("--tokens", type=int, default=160, help="reply tokens")
    parser.add_argument("--draft-tokens", type=int, nargs="+", default=[2, 3, 4])
    parser.add_argument("--repeats", type=int, default=1, help="passes over the prompts")
    parser.add_argument("--engine", action="store_true",
                        help="the engine's num_draft_tokens against its plain decoding")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.target_shape:
        args.target, args.draft = random_pair(args)
    if not (args.target and args.draft):
        parser.error("give --target and --draft, or --target-shape")
    if args.engine:
        rows = engine_rows(args)
        table = engine_table(args, rows)
        if args.json:
            Path(args.json).write_text(json.dumps({"rows": rows, "table": table,
                                                   "args": vars(args)}, indent=2))
        return
    model, tokenizer = load_model(args.target)  # float32 on a CPU, as the engine runs it
    draft, _ = load_model(args.draft)
    shapes = shape_of(model), shape_of(draft)
    plain(model, prompts(tokenizer, "code", 1)[0], 8)  # warm up both paths
    speculative(model, draft, prompts(tokenizer, "code", 1)[0], 8, args.draft_tokens[0])
    rows = []
    for repeat in range(args.repeats):
        for kind in args.kinds:
            for index, prompt in enumerate(prompts(tokenizer, kind, args.prompts)):
                reference = plain(model, prompt, args.tokens)
                rows.append({"kind": kind, "prompt": index, "repeat": repeat, "k": 0,
                             "tok_s": reference["tok_s"], "tokens": len(reference["tokens"])})
                for k in args.draft_tokens:
                    run = speculative(model, draft, prompt, args.tokens, k)
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
        for k in args.draft_tokens:
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
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "table": table,
                                               "mac_reference": mac_projection.REFERENCE,
                                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
