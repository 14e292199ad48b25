"""The users' job: a scripted agent loop, one growing prompt, served side by side by
mlx-lm with its own prompt cache and by the engine three ways.

Context: system prompt + tool definitions + retrieved documents (`--tokens`), then
`--steps` steps, each appending the last reply, a tool result of 200-500 tokens and a
question about another fact of the documents (`demo_tasks.make_agent_session`). Between
a reply and the next request the agent runs its tool for `--tool-seconds`. Per step:
time to first token, tokens through the draft and the target, and whether the answer is
right; per row, the loop's critical-path prefill (the sum of its TTFTs). Rows:
- mlx-lm + prompt cache: `generate_step` with mlx-lm's own `LRUPromptCache` (its
  server's: the nearest cached prefix, trimmed where the cache can be; as its server
  keeps segment ends, a copy at the prompt's end and the cache after the reply);
- dense + prefix cache;
- SpecPrefill + reuse (densify off): sparse-prefix reuse behind the coverage gate;
- SpecPrefill + densify: SpecPrefill turns, their dense KV computed while the agent's
  tool runs.
Each session runs every row in turn (the order rotating from session to session), each
on a fresh engine (or cache) warmed up first.

    .venv/bin/python benchmarks/agent.py --tokens 6000 --sessions 2 --json docs/agent-cpu.json
    python benchmarks/agent.py --target-shape qwen3-8b --tokens 32000 --sessions 1 \\
        --tool-seconds 2 --json agent-gpu.json                                # GPU timing
    python benchmarks/agent.py --target-shape qwen3-next-8b --tokens 32000 ...  # a hybrid
"""

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.utils import load_tokenizer

from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_agent_session
from specprefill_engine.loading import DEMO_TARGET, load_model

from random_models import add_pair_arguments, random_pair

NEW_TOKENS = 12
METHODS = {
    "mlx-lm + prompt cache": None,
    "dense + prefix cache": dict(engine={"densify": "off"}, request={"specprefill": False}),
    "SpecPrefill + reuse": dict(engine={"densify": "off"}, request={"specprefill": True}),
    "SpecPrefill + densify": dict(engine={"densify": "idle"}, request={"specprefill": True}),
}


def _fed(cache: list) -> int:
    """Entries the cache holds (its first plain KV layer's count)."""
    return next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))


def mlx_lm_session(model, tokenizer, store, session, args) -> list:
    """One session through mlx-lm: its prompt cache `store` kept as its server keeps it
    (the nearest cached prefix, trimmed where the cache can be; a copy at the prompt's
    end, the cache after the reply)."""
    rows, replies = [], []
    for step in range(args.steps):
        messages = session.messages(step, replies)
        tokens = tokenizer.apply_chat_template(messages, tools=list(session.tools),
                                               add_generation_prompt=True)
        started = time.perf_counter()
        cache, rest = store.fetch_nearest_cache("model", tokens)
        cache = make_prompt_cache(model) if cache is None else cache
        cached = len(tokens) - len(rest)
        for start in range(0, len(rest) - 1, args.step_size):  # the prompt but its last token
            model(mx.array(rest[start : min(start + args.step_size, len(rest) - 1)])[None],
                  cache=cache)
            mx.eval([c.state for c in cache])
        store.insert_cache("model", tokens[:-1], copy.deepcopy(cache), cache_type="user")
        fed, ttft = [], None
        for token, _ in generate_step(mx.array(rest[-1:]), model, max_tokens=NEW_TOKENS,
                                      prompt_cache=cache):
            ttft = ttft or time.perf_counter() - started
            fed.append(int(token))
            if token in tokenizer.eos_token_ids:
                break
        store.insert_cache("model", (tokens + fed)[: _fed(cache)], cache)
        reply = tokenizer.decode([t for t in fed if t not in tokenizer.eos_token_ids])
        replies.append(reply)
        rows.append({"prompt_tokens": len(tokens), "ttft": ttft, "draft_tokens": 0,
                     "target_tokens": len(tokens) - cached, "reply": reply, "reuse": ""})
        time.sleep(args.tool_seconds)
    return rows


def engine_session(engine, settings, session, args) -> list:
    rows, replies = [], []
    for step in range(args.steps):
        result = engine.generate_sync(session.messages(step, replies), max_tokens=NEW_TOKENS,
                                      tools=list(session.tools), **settings["request"])
        replies.append(result.text)
        usage, report = result.usage, result.specprefill
        draft_tokens = usage.prompt_tokens - usage.draft_cached_tokens if report.engaged else 0
        target_tokens = (report.kept_tokens if report.engaged else usage.prompt_tokens) \
            - usage.cached_tokens
        rows.append({"prompt_tokens": usage.prompt_tokens, "ttft": result.timings.time_to_first_token,
                     "draft_tokens": draft_tokens, "target_tokens": target_tokens,
                     "reply": result.text, "reuse": report.reuse, "engaged": report.engaged})
        time.sleep(args.tool_seconds)
    return rows


def run(args) -> list:
    """Sessions one after another; in each, the rows in turn, each on its own engine (or
    mlx-lm's model), so one target is in memory at a time."""
    rows = []
    caches = {"prefix_cache_bytes": int(args.cache_gb * 2**30),
              "draft_prefix_cache_bytes": int(args.cache_gb * 2**30)}
    tokenizer = load_tokenizer(Path(args.target) if args.target else DEMO_TARGET)
    warm = argparse.Namespace(**{**vars(args), "steps": 2, "tool_seconds": 0})
    for session_index in range(args.sessions):
        turn = session_index % len(args.methods)  # the order rotates from session to session
        for name in args.methods[turn:] + args.methods[:turn]:
            session = make_agent_session(tokenizer, session_index, args.tokens, args.steps)
            warm_session = make_agent_session(tokenizer, 99, args.tokens, 2)  # same shapes
            if METHODS[name] is None:  # a fresh cache after the warm-up: no big entry to copy
                model, _ = load_model(args.target) if args.target else load_model()
                mlx_lm_session(model, tokenizer, LRUPromptCache(16), warm_session, warm)
                session_rows = mlx_lm_session(model, tokenizer, LRUPromptCache(16), session, args)
                del model
                mx.clear_cache()
            else:
                with Engine(model=args.target, draft=args.draft, keep=args.keep,
                            reuse_coverage=args.coverage, step_size=args.step_size,
                            **caches, **METHODS[name]["engine"]) as engine:
                    engine_session(engine, METHODS[name], warm_session, warm)
                    while engine.stats()["densify"].pending:  # idle before the session
                        time.sleep(0.05)
                    session_rows = engine_session(engine, METHODS[name], session, args)
            for step, row in enumerate(session_rows):
                row.update(method=name, session=session_index, step=step + 1,
                           correct=row["reply"].strip() == session.answers[step])
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def summary(rows: list, steps: int, methods: list) -> dict:
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
    totals = {name: sum(line[name]["ttft"] for line in table) for name in methods}
    later = {name: sum(line[name]["ttft"] for line in table[1:]) for name in methods}
    accuracy = {name: statistics.mean(r["correct"] for r in rows if r["method"] == name)
                for name in methods}
    return {"steps": table, "critical_path_prefill_s": totals, "steps_2_on_s": later,
            "accuracy": accuracy}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="target model path (default: the demo target)")
    parser.add_argument("--draft", help="draft model path (default: the demo draft)")
    add_pair_arguments(parser)
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--tool-seconds", type=float, default=0.0,
                        help="the agent's tool time between a reply and the next request")
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--coverage", type=float, default=0.9, help="the reuse gate")
    parser.add_argument("--step-size", type=int, help="prefill unit (default: the device's)")
    parser.add_argument("--cache-gb", type=float, default=8.0,
                        help="each prefix cache's budget (an 8B target's KV is ~0.15 MB/token)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--json", help="write rows and the summary here")
    args = parser.parse_args()
    if args.step_size is None:
        args.step_size = 256 if mx.default_device() == mx.cpu else 2048
    if args.target_shape:
        args.target, args.draft = random_pair(args)
    rows = run(args)
    result = summary(rows, args.steps, args.methods)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": result,
                                               "args": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
