"""A scripted agent loop: one growing prompt served three ways, step by step.

Context: system prompt + tool definitions + retrieved documents (`--tokens`), then
`--steps` steps, each appending a tool result of 200-500 tokens and asking about a
different fact of the documents (`demo_tasks.make_agent_session`). Per step: time to
first token, tokens through the draft and through the target, and whether the answer
is right, for
- dense with the prefix cache,
- SpecPrefill re-scoring everything each step (the prefix caches off: the behaviour
  before agent-turn reuse),
- SpecPrefill with reuse (draft prefix cache, sparse-prefix reuse behind the gate).
Each method runs on its own engine, sessions one after another.

    .venv/bin/python benchmarks/agent.py --tokens 6000 --sessions 3 --json docs/agent-cpu.json
    python benchmarks/agent.py --target-shape qwen3-8b --tokens 16000 --sessions 1   # GPU timing
"""

import argparse
import json
import statistics
from pathlib import Path

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_agent_session

METHODS = {
    "dense + prefix cache": dict(engine={}, request={"specprefill": False}),
    "SpecPrefill, re-scoring": dict(engine={"prefix_cache_bytes": 0, "draft_prefix_cache_bytes": 0},
                                    request={"specprefill": True}),
    "SpecPrefill + reuse": dict(engine={}, request={"specprefill": True}),
}


def run_method(name: str, args) -> list:
    settings = METHODS[name]
    rows = []
    caches = {"prefix_cache_bytes": int(args.cache_gb * 2**30),
              "draft_prefix_cache_bytes": int(args.cache_gb * 2**30)}
    with Engine(model=args.target, draft=args.draft, keep=args.keep,
                reuse_coverage=args.coverage, **{**caches, **settings["engine"]}) as engine:
        engine.generate_sync("def warm():", max_tokens=2, specprefill=False)
        for session_index in range(args.sessions):
            session = make_agent_session(engine.tokenizer, session_index, args.tokens, args.steps)
            replies = []
            for step in range(args.steps):
                result = engine.generate_sync(session.messages(step, replies), max_tokens=12,
                                              tools=list(session.tools), **settings["request"])
                replies.append(result.text)
                usage, report = result.usage, result.specprefill
                draft_tokens = usage.prompt_tokens - usage.draft_cached_tokens if report.engaged else 0
                target_tokens = (report.kept_tokens if report.engaged else usage.prompt_tokens) \
                    - usage.cached_tokens
                rows.append({
                    "method": name, "session": session_index, "step": step + 1,
                    "prompt_tokens": usage.prompt_tokens,
                    "ttft": result.timings.time_to_first_token,
                    "draft_tokens": draft_tokens, "target_tokens": target_tokens,
                    "correct": result.text.strip() == session.answers[step],
                    "reuse": report.reuse, "engaged": report.engaged,
                })
                print(json.dumps(rows[-1]), flush=True)
    return rows


def summary(rows: list, steps: int, methods: list) -> list:
    table = []
    for step in range(1, steps + 1):
        line = {"step": step}
        for name in methods:
            picked = [r for r in rows if r["method"] == name and r["step"] == step]
            line[name] = {
                "ttft": statistics.median(r["ttft"] for r in picked),
                "draft_tokens": statistics.median(r["draft_tokens"] for r in picked),
                "target_tokens": statistics.median(r["target_tokens"] for r in picked),
                "accuracy": sum(r["correct"] for r in picked) / len(picked),
            }
        table.append(line)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target model path (default: the demo target)")
    parser.add_argument("--draft", help="draft model path (default: the demo draft)")
    parser.add_argument("--target-shape", help="random-weight Qwen3 shape for the target "
                        "(GPU timing; answers are meaningless), e.g. qwen3-8b")
    parser.add_argument("--draft-shape", default="qwen3-0.6b")
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--coverage", type=float, default=0.9, help="the reuse gate")
    parser.add_argument("--cache-gb", type=float, default=4.0,
                        help="each prefix cache's budget (an 8B target's KV is ~0.15 MB/token)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--json", help="write rows and the per-step summary here")
    args = parser.parse_args()
    if args.target_shape:
        from random_models import random_model_dir

        args.target = random_model_dir(args.target_shape)
        args.draft = random_model_dir(args.draft_shape, seed=1)
    rows = [row for name in args.methods for row in run_method(name, args)]
    table = summary(rows, args.steps, args.methods)
    for line in table:
        print(json.dumps(line))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": table,
                                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
