"""A later turn's short reply after a long cached prompt: the engine against mlx-lm,
alternating in one process.

An agent's turn adds a few hundred tokens to a long conversation and often answers in a
handful (a value, a short tool call), so its wall time is the cached prefix's reuse, a
short prefill and a few decode steps: per-request costs that a 150-token reply hides show
here. Each repeat, both sides with the conversation's first turn already cached:
- `mlx-lm`: a copy of its cache of the first turn (what its server's prompt cache hands
  a later turn), the turn's new tokens prefilled, then `generate_step`;
- `engine`: `Engine.generate_sync` of the turn (the first turn restored from its prefix
  cache).
Random token ids (`--new` tokens added, `--new-tokens` of reply, EOS ignored), or with
`--chat` the demo agent's conversation (system prompt, tools, documents; the turn adds a
reply, a tool result and a question; the reply ends at EOS), whose chat template and
tokenizing count on both sides. Per side: the wall from the call to the last token, the
time to first token, the rest (decode) and the reply's tokens. `--breakdown` times the
engine worker's turns by what ran in them (its methods wrapped here) and lists one
request's.

    .venv/bin/python benchmarks/short_reply.py --shape qwen3-small --prompt 2048 --repeats 4  # CPU
    python benchmarks/short_reply.py --model PAIR/qwen2.5-coder-1.5b --chat --prompt 16000 \
        --new-tokens 150 --breakdown --json out.json                                     # GPU
"""

import copy
import json
import statistics
import time
from collections import defaultdict
from functools import partial
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm import convert
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from random_models import random_model_dir
from specprefill_engine import Engine
from specprefill_engine.demo_tasks import make_agent_session
from specprefill_engine.engine.batch import DecodeBatch
from specprefill_engine.engine.executor import Executor
from specprefill_engine.engine.worker import Worker
from specprefill_engine.loading import load_model
from throughput import decode_arguments, prompts

TIMED = ((Worker, "_turn"), (Worker, "_take_new"), (Worker, "_plan_prefill"), (Worker, "_absorb"),
         (DecodeBatch, "_read"), (Executor, "run"), (Executor, "_store"), (Executor, "_join"),
         (Executor, "_restore"), (Executor, "_chunk"), (DecodeBatch, "step"))


def timed(log: list):
    """Wrap the worker's and executor's methods in TIMED: each call appends
    (name, start, seconds) to `log`."""
    for owner, name in TIMED:
        method = getattr(owner, name)

        def wrapper(*args, _method=method, _name=f"{owner.__name__}.{name}", **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                log.append((_name, start, time.perf_counter() - start))
        setattr(owner, name, wrapper)


def quantized(path: str, bits: int) -> str:
    """The random model's folder quantized (as the real pair runs on the GPU), made once."""
    out = Path(f"{path}-q{bits}")
    if not (out / "config.json").exists():
        convert(hf_path=path, mlx_path=str(out), quantize=True, q_bits=bits, q_group_size=64)
    return str(out)


def mlx_lm_turn(model, stored: list, render, cached: int, reply: int, step: int,
                eos=()) -> dict:
    """`render()`: the turn's token ids (a chat's template runs inside the timing, as the
    engine's time to first token counts it); `stored`: the cache of its first `cached`."""
    started = time.perf_counter()
    new = render()[cached:]
    cache = copy.deepcopy(stored)
    for start in range(0, len(new) - 1, step):
        model(mx.array(new[start : min(start + step, len(new) - 1)])[None], cache=cache)
        mx.eval([c.state for c in cache])
    stamps = []
    for token, _ in generate_step(mx.array(new[-1:]), model, max_tokens=reply,
                                  prompt_cache=cache):
        stamps.append(time.perf_counter())
        if token in eos:
            break
    return {"ttft": stamps[0] - started, "wall": stamps[-1] - started,
            "tokens": len(stamps) - (token in eos)}


def engine_turn(engine, prompt, reply: int, **request) -> dict:
    started = time.perf_counter()
    result = engine.generate_sync(prompt, max_tokens=reply, specprefill=False,
                                  **({"ignore_eos": True} | request))
    wall = time.perf_counter() - started
    return {"ttft": result.timings.time_to_first_token, "wall": wall,
            "tokens": result.usage.completion_tokens}


def turns(log: list, since: float) -> list:
    """The worker's turns that ended after `since`: each one's time (less its wait for
    a submission) and what ran in it."""
    out = []
    for name, start, seconds in log:
        if name != "Worker._turn" or start + seconds < since:
            continue
        inner = [(n, round(1e3 * s, 2)) for n, st, s in log
                 if st >= start and st + s <= start + seconds and n != "Worker._turn"]
        waited = sum(ms for n, ms in inner if n == "Worker._take_new")
        inner = [item for item in inner if item[0] != "Worker._take_new"]
        out.append({"ms": round(1e3 * seconds - waited, 2), "inner": inner})
    return out


def summary(rows: list) -> dict:
    return {key: statistics.median(r[key] for r in rows) for key in ("ttft", "wall")} | {
        "decode": statistics.median(r["wall"] - r["ttft"] for r in rows),
        "tokens": statistics.median(r["tokens"] for r in rows),
        "walls": [round(r["wall"], 4) for r in rows]}


def main():
    parser = decode_arguments(__doc__, repeats=12)
    parser.add_argument("--new", type=int, default=64, help="tokens the turn adds")
    parser.add_argument("--step", type=int, default=2048, help="mlx-lm's prefill chunk")
    parser.add_argument("--model", help="a model folder (instead of --shape)")
    parser.add_argument("--draft", help="the engine's draft model folder (loaded, unused)")
    parser.add_argument("--chat", action="store_true",
                        help="the demo agent's chat (messages, tools) at --prompt tokens")
    parser.add_argument("--bits", type=int, help="quantize the random model to these bits")
    parser.add_argument("--breakdown", action="store_true",
                        help="time the engine worker's turns (its methods wrapped)")
    parser.set_defaults(new_tokens=7)
    args = parser.parse_args()
    log: list = []
    if args.breakdown:
        timed(log)
    path = args.model or (random_model_dir(args.shape) if args.shape else None)
    if path and args.bits:
        path = quantized(path, args.bits)
    model, tokenizer = load_model(path) if path else load_model()
    vocab = min(tokenizer.vocab_size, 32000)
    sides = defaultdict(list)
    listed = None
    with Engine(model=path, draft=args.draft, densify="off") as engine:
        for repeat in range(args.repeats + 1):  # the first warms both sides up
            ids = prompts(1, args.prompt, vocab, 100 + repeat)[0]
            more = ids + prompts(1, args.new, vocab, 200 + repeat)[0]
            first, second, render = ids, more, partial(list, more)
            request, eos = {}, ()
            if args.chat:  # an agent's turn: its tool result and question, the reply to EOS
                session = make_agent_session(tokenizer, repeat, args.prompt, 2)
                tools = list(session.tools)
                first, second = session.messages(0, []), session.messages(1, ["123456"])
                ids = tokenizer.apply_chat_template(first, tools=tools, add_generation_prompt=True)
                render = partial(tokenizer.apply_chat_template, second, tools=tools,
                                 add_generation_prompt=True)
                assert render()[: len(ids)] == ids, "the chat's second turn does not extend its first"
                request, eos = {"tools": tools, "ignore_eos": False}, tokenizer.eos_token_ids
            stored = make_prompt_cache(model)
            for start in range(0, len(ids), args.step):
                model(mx.array(ids[start : start + args.step])[None], cache=stored)
                mx.eval([c.state for c in stored])
            engine.generate_sync(first, max_tokens=1, specprefill=False,
                                 tools=request.get("tools"))  # its prompt cached
            order = ("mlx-lm", "engine") if repeat % 2 else ("engine", "mlx-lm")
            for side in order:
                since = time.perf_counter()
                row = (mlx_lm_turn(model, stored, render, len(ids), args.new_tokens, args.step,
                                   eos)
                       if side == "mlx-lm" else
                       engine_turn(engine, second, args.new_tokens, **request))
                if repeat:
                    sides[side].append(row)
                    print(json.dumps({"repeat": repeat, "side": side, **row}), flush=True)
                if side == "engine" and repeat == 1:
                    listed = turns(log, since)
            del stored
            mx.clear_cache()
    out = {side: summary(rows) for side, rows in sides.items()}
    base = out["mlx-lm"]["wall"]
    for side, row in out.items():
        print(f"{side:8s} wall {row['wall']:.4f} s ({row['wall'] / base:.2f}x mlx-lm)  "
              f"ttft {row['ttft']:.4f}  decode {row['decode']:.4f}  tokens {row['tokens']:g}  "
              f"walls {row['walls']}",
              flush=True)
    if listed is not None:
        out["engine_turns"] = listed
        for turn in listed:
            print(f"  turn {turn['ms']:8.2f} ms  {turn['inner']}")
    out["args"] = vars(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
