"""The users' job: a scripted agent loop, one growing prompt, served side by side by
mlx-lm with its own prompt cache and by the engine three ways.

Context: system prompt + tool definitions + retrieved documents (`--lengths`), then
`--steps` steps, each appending the last reply, a tool result of 200-500 tokens and a
question about another fact of the documents (`demo_tasks.make_agent_session`). Between
a reply and the next request the agent runs its tool for `--tool-seconds`; each reply
is `--reply-tokens` long (agents write 100-500: tool calls and reasoning; the demo
models answer, then go on). Per step: time to first token, decode time, wall time (the
two), tokens through the draft and the target, what reuse chose, whether the answer is
right (the reply starts with it); per row, the loop's wall time and critical-path
prefill (tool time excluded), and both projected to a Mac from the token counts
(common.py's M3 Pro rates, labelled projected). Rows:
- mlx-lm + prompt cache: `generate_step` with mlx-lm's own `LRUPromptCache` (its
  server's: the nearest cached prefix, trimmed where the cache can be; as its server
  keeps segment ends, a copy at the prompt's end and the cache after the reply);
- dense + prefix cache;
- SpecPrefill + reuse (densify off): sparse-prefix reuse behind the coverage gate;
- SpecPrefill + densify: SpecPrefill turns, their dense KV computed while the agent's
  tool runs;
- engine default: what `Engine()` does with no settings (the automatic policy, repair,
  densify while idle), at the engine's default cache budgets;
- default, draft unchecked: the same with `draft_check="off"` (the policy on speed alone).
Each session runs every row in turn (the order rotating from session to session), each
on a fresh engine (or cache) warmed up first.

    python benchmarks/agent.py --lengths 6000 --repeats 2 --json agent-cpu.json
    python benchmarks/agent.py --shape qwen3-8b --lengths 32000 --repeats 1 \\
        --tool-seconds 2 --reply-tokens 150 --json agent-gpu.json             # GPU timing
    python benchmarks/agent.py --shape qwen3-next-8b --lengths 8000 ...       # a hybrid
    python benchmarks/agent.py --replay-debt FOLDER  # the policy's debt over a grid's files
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
from specprefill_engine.core.matching import MATCH_WEIGHT
from specprefill_engine.demo_tasks import make_agent_session
from specprefill_engine.engine.policy import shape_of
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET, load_model

from common import (
    MAC_REFERENCE, add_model_arguments, add_run_arguments, mac_turn_s, model_folders, write_json,
)

METHODS = {
    "mlx-lm + prompt cache": None,
    "dense + prefix cache": dict(engine={"densify": "off"}, request={"specprefill": False}),
    "SpecPrefill + reuse": dict(engine={"densify": "off"}, request={"specprefill": True}),
    "SpecPrefill + densify": dict(engine={"densify": "idle"}, request={"specprefill": True}),
    "engine default": dict(engine={}, request={}),
    # the policy on speed alone: random-weight shapes answer no probe, so the draft check
    # (rightly) declines them; this row shows what the policy's cost model would choose
    "default, draft unchecked": dict(engine={"draft_check": "off"}, request={}),
}


def _fed(cache: list) -> int:
    """Entries the cache holds (its first plain KV layer's count)."""
    return next(c.offset for c in cache if isinstance(getattr(c, "offset", None), int))


def mlx_lm_turn(model, tokenizer, store, tokens: list, args, started: float) -> dict:
    """One request through mlx-lm, its prompt cache `store` kept as its server keeps it
    (the nearest cached prefix, trimmed where the cache can be; a copy at the prompt's
    end, the cache after the reply). `started`: when the turn began, before its chat
    template (the engine's time to first token counts its template too)."""
    cache, rest = store.fetch_nearest_cache("model", tokens)
    cache = make_prompt_cache(model) if cache is None else cache
    cached = len(tokens) - len(rest)
    for start in range(0, len(rest) - 1, args.step_size):  # the prompt but its last token
        model(mx.array(rest[start : min(start + args.step_size, len(rest) - 1)])[None],
              cache=cache)
        mx.eval([c.state for c in cache])
    store.insert_cache("model", tokens[:-1], copy.deepcopy(cache), cache_type="user")
    fed, ttft, stopped = [], None, False
    for token, _ in generate_step(mx.array(rest[-1:]), model, max_tokens=args.reply_tokens,
                                  prompt_cache=cache):
        ttft = ttft or time.perf_counter() - started
        fed.append(int(token))
        if token in tokenizer.eos_token_ids and not args.ignore_eos:
            stopped = True
            break
    wall = time.perf_counter() - started
    store.insert_cache("model", (tokens + fed)[: _fed(cache)], cache)
    reply = tokenizer.decode([t for t in fed if t not in tokenizer.eos_token_ids])
    return {"prompt_tokens": len(tokens), "ttft": ttft, "wall": wall,
            "decode": wall - ttft, "reply_tokens": len(fed) - stopped,  # as the engine counts
            "draft_tokens": 0,
            "draft_cached": 0, "target_tokens": len(tokens) - cached,
            "target_cached": cached, "reply": reply, "reuse": ""}


def mlx_lm_session(model, tokenizer, store, session, args) -> list:
    """One session through mlx-lm (`mlx_lm_turn` per step)."""
    rows, replies = [], []
    for step in range(args.steps):
        messages = session.messages(step, replies)
        started = time.perf_counter()
        tokens = tokenizer.apply_chat_template(messages, tools=list(session.tools),
                                               add_generation_prompt=True)
        rows.append(mlx_lm_turn(model, tokenizer, store, tokens, args, started))
        replies.append(rows[-1]["reply"])
        time.sleep(args.tool_seconds)
    return rows


def engine_turn(engine, request: dict, messages: list, tools: list, args) -> dict:
    """One request through the engine; the tokens through the draft and the target from
    its usage and SpecPrefill report."""
    started = time.perf_counter()
    result = engine.generate_sync(messages, max_tokens=args.reply_tokens,
                                  ignore_eos=args.ignore_eos, tools=tools, **request)
    wall = time.perf_counter() - started
    usage, report = result.usage, result.specprefill
    draft_tokens = usage.prompt_tokens - usage.draft_cached_tokens if report.engaged else 0
    target_tokens = (report.kept_tokens if report.engaged else usage.prompt_tokens) \
        - usage.cached_tokens
    ttft = result.timings.time_to_first_token
    return {"prompt_tokens": usage.prompt_tokens, "ttft": ttft, "wall": wall,
            "decode": wall - ttft, "reply_tokens": usage.completion_tokens,
            "draft_tokens": draft_tokens, "draft_cached": usage.draft_cached_tokens,
            "target_tokens": target_tokens, "target_cached": usage.cached_tokens,
            "kept_tokens": report.kept_tokens, "reply": result.text,
            "reuse": report.reuse, "engaged": report.engaged, "reason": report.reason}


def engine_session(engine, settings, session, args) -> list:
    rows, replies = [], []
    for step in range(args.steps):
        rows.append(engine_turn(engine, settings["request"], session.messages(step, replies),
                                list(session.tools), args))
        replies.append(rows[-1]["reply"])
        time.sleep(args.tool_seconds)
    return rows


def run(args) -> list:
    """Sessions one after another; in each, the rows in turn, each on its own engine (or
    mlx-lm's model), so one target is in memory at a time."""
    rows = []
    caches = {} if args.cache_gb is None else {
        "prefix_cache_bytes": int(args.cache_gb * 2**30),
        "draft_prefix_cache_bytes": int(args.cache_gb * 2**30)}
    tokenizer = load_tokenizer(Path(args.target) if args.target else DEMO_TARGET)
    shapes = [shape_of(load_model(path, default=default)[0])
              for path, default in ((args.target, DEMO_TARGET), (args.draft, DEMO_DRAFT))]
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
                settings = {"keep": args.keep, "reuse_coverage": args.coverage,
                            "step_size": args.step_size, "match_weight": args.match_weight,
                            **caches}
                if name in ("engine default", "default, draft unchecked"):
                    settings = {}
                with Engine(model=args.target, draft=args.draft, **settings,
                            **METHODS[name]["engine"]) as engine:
                    engine_session(engine, METHODS[name], warm_session, warm)
                    while engine.stats()["densify"].pending:  # idle before the session
                        time.sleep(0.05)
                    session_rows = engine_session(engine, METHODS[name], session, args)
            for step, row in enumerate(session_rows):
                row.update(method=name, session=session_index, step=step + 1,
                           correct=row["reply"].strip().startswith(session.answers[step]),
                           mac_projected=mac_turn_s(*shapes, row))
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
                "wall": statistics.median(r["wall"] for r in picked),
                "decode": statistics.median(r["decode"] for r in picked),
                "mac_projected_wall": statistics.median(r["mac_projected"]["wall"] for r in picked),
                "mac_projected_ttft": statistics.median(r["mac_projected"]["ttft"] for r in picked),
                "draft_tokens": statistics.median(r["draft_tokens"] for r in picked),
                "target_tokens": statistics.median(r["target_tokens"] for r in picked),
                "accuracy": sum(r["correct"] for r in picked) / len(picked),
            }
        table.append(line)
    totals = {name: sum(line[name]["ttft"] for line in table) for name in methods}
    later = {name: sum(line[name]["ttft"] for line in table[1:]) for name in methods}
    accuracy = {name: statistics.mean(r["correct"] for r in rows if r["method"] == name)
                for name in methods}
    def total(key):
        return {name: sum(line[name][key] for line in table) for name in methods}

    return {"steps": table, "critical_path_prefill_s": totals, "steps_2_on_s": later,
            "wall_s": total("wall"), "decode_s": total("decode"),
            "mac_projected_wall_s": total("mac_projected_wall"),
            "mac_projected_critical_path_s": total("mac_projected_ttft"),
            "mac_reference": MAC_REFERENCE, "accuracy": accuracy}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_run_arguments(parser, lengths=[6000], repeats=2, one_length=True,
                      what="the context's tokens before the first step",
                      repeats_what="sessions (each runs every row, the order rotating)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tool-seconds", type=float, default=0.0,
                        help="the agent's tool time between a reply and the next request")
    parser.add_argument("--reply-tokens", type=int, default=12, help="tokens per reply")
    parser.add_argument("--stop-at-eos", dest="ignore_eos", action="store_false",
                        help="replies end at EOS (default: every reply is --reply-tokens long)")
    parser.add_argument("--keep", type=float, default=0.3)
    parser.add_argument("--coverage", type=float, default=0.9, help="the reuse gate")
    parser.add_argument("--match-weight", type=float, default=MATCH_WEIGHT,
                        help="the engine rows' `match_weight` (but the default row's)")
    parser.add_argument("--step-size", type=int, help="prefill unit (default: the device's)")
    parser.add_argument("--cache-gb", type=float,
                        help="each prefix cache's budget (default: the engine's)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--replay-debt", type=Path, metavar="FOLDER",
                        help="run nothing: replay the policy's conversation debt over an agent "
                             "grid's files (debt_replay.py) and print its table")
    args = parser.parse_args(argv)
    if args.replay_debt is not None:
        from debt_replay import markdown, replay
        rows = replay(args.replay_debt)
        print(markdown(rows))
        write_json(args.json, {"replay": rows,
                               "args": {**vars(args), "replay_debt": str(args.replay_debt)}})
        return 0
    if args.step_size is None:
        args.step_size = 256 if mx.default_device() == mx.cpu else 2048
    args.target, args.draft = model_folders(args)
    args.tokens, args.sessions = args.lengths[0], args.repeats
    rows = run(args)
    result = summary(rows, args.steps, args.methods)
    print(json.dumps(result, indent=2))
    write_json(args.json, {"rows": rows, "summary": result, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
