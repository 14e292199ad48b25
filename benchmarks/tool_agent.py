"""An agent loop with real tool calls: the model calls `list_files`, `read_file` and
`grep` through its own chat template over a generated repository until it answers,
served side by side by mlx-lm with its own prompt cache and by the engine.

The repository (deterministic from `--seed` and the task) is `--files` Python modules
of similar functions, `--lengths` tokens in all; one function holds the answer to the
task's question: "what constant does `compute_x` add?" or "which function calls
`helper_y`?", asked after "Look in the repository with the tools." (no system prompt
of ours: `--system`). With `--questions N` a loop asks N such questions one after
another in one conversation, each naming its function's file (the k-th question the k-th
file, round-robin): the conversation grows by a file read per question, as a coding
agent's does, and questions past `--files` return to files read before. grep shows
matching lines only, so an answer needs a `read_file`.
Each reply is parsed by the engine's own `OutputParser` (as its server and LangChain
model) for every row, so the conversations are comparable: valid calls run (then
`--tool-seconds` of sleep each, the tool's time), an invalid call gets its error back as
a user message, a reply without a call answers the question. A call written as fenced
(or bare) JSON instead of the template's markup that the parser reads back anyway is
counted as "recovered"; one it does not read is "fenced call (not recovered)" and is
taken as a wrong answer. At most `--turns` requests a question, replies up to
`--reply-tokens`, greedy. Rows, each on a fresh engine (or mlx-lm model)
per task, warmed up with one turn of another task (so every row starts with the system
prompt and tools cached), the order rotating from task to task:
- mlx-lm: `generate_step` with mlx-lm's `LRUPromptCache`, kept as its server keeps it
  (`agent.py`'s `mlx_lm_turn`; the history's call arguments as objects, as its server
  passes them to the template);
- dense: the engine, SpecPrefill off, densify off, its prefix cache;
- SpecPrefill + reuse: SpecPrefill on every turn, densify off: later turns reuse, extend
  or repair the sparse view (the quality of sparse reuse itself);
- default: `Engine(model, draft)` with no settings (the automatic policy).
Per turn: TTFT, decode, wall, prompt tokens, tokens through the draft and the target,
what reuse chose and the reuse gate's coverage; per loop: tool calls, valid ones
(parsed, a declared name, schema-valid arguments), turns, the answers right,
and a Mac projection of the turns from their token counts (common.py's M3 Pro
rates, projected, not measured).

    python benchmarks/tool_agent.py --model PATH --draft PATH --repeats 2 --lengths 1500 \\
        --turns 6 --reply-tokens 96 --json tool-agent-cpu.json        # this CPU
    python benchmarks/tool_agent.py --model PATH --draft PATH --repeats 2 --lengths 24000 \\
        --files 8 --questions 10 --scripted-reads --turns 2 --json tool-agent-gpu.json
    python benchmarks/tool_agent.py --table tool-agent-cpu.json       # the tables again
"""

import argparse
import json
import random
import re
import statistics
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import LRUPromptCache
from mlx_lm.utils import load_tokenizer

from specprefill_engine import Engine
from specprefill_engine.engine.policy import shape_of
from specprefill_engine.engine.runtime import default_step_size
from specprefill_engine.chat.parser_events import TextEvent, ToolCallEvent
from specprefill_engine.chat.tool_calls import OutputParser
from specprefill_engine.loading import DEMO_DRAFT, DEMO_TARGET, load_model

from agent import engine_turn, mlx_lm_turn
from common import (
    MAC_REFERENCE, add_model_arguments, add_run_arguments, mac_turn_s, model_folders, write_json,
)

METHODS = {
    "mlx-lm": None,
    "dense": dict(engine={"densify": "off"}, request={"specprefill": False}),
    "SpecPrefill + reuse": dict(engine={"densify": "off"}, request={"specprefill": True}),
    "default": dict(engine={}, request={}),
}
TOOLS = [
    {"type": "function", "function": {
        "name": "list_files", "description": "List the repository's files.",
        "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read one file of the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "the file's path, as list_files shows it"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "grep", "description": "The lines of the repository matching a regular "
        "expression, as path:line: text.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string", "description": "a Python regular expression"}},
            "required": ["pattern"]}}},
]
# The template's own system prompt (none of ours) and this lead-in make Qwen2.5-Coder
# call tools at all; with a system prompt of instructions it answered from nothing.
ASK = "Look in the repository with the tools. "
MODULES = ("billing", "geometry", "inventory", "routing", "telemetry", "pricing", "sensors",
           "ledger")
WORDS = ("tariff margin parcel rebate quota beacon cargo depot freight harbor invoice "
         "kernel lattice meter orbit pallet quarry rotor signal tensor vector voltage "
         "wafer yield zenith anchor bridge canal dial ember flux gauge hinge ingot joist "
         "keel lever mantle nozzle piston radius sprocket tether valve welder axle bolt "
         "crate drum flange girder hopper lintel mortar pylon rivet spindle truss").split()
# a call written as a fenced JSON block (or bare JSON) instead of the template's markup
FENCED = re.compile(r'```(?:json)?\s*\{\s*"name"\s*:|^\s*\{\s*"name"\s*:', re.MULTILINE)
FENCED_NAME = re.compile(r'"name"\s*:\s*"([^"]*)"')


@dataclass
class Task:
    files: dict  # path -> text
    questions: list  # (question, answer, kind, file the harness reads first or None), in turn

    def run_tool(self, name: str, arguments: dict) -> str:
        if name == "list_files":
            return "\n".join(f"{path} ({text.count(chr(10))} lines)"
                             for path, text in self.files.items())
        if name == "read_file":
            path = str(arguments.get("path", "")).lstrip("./")
            if path not in self.files:
                return f"error: no file {arguments.get('path')!r}; list_files shows the files"
            return self.files[path]
        pattern = str(arguments.get("pattern", ""))
        try:
            match = re.compile(pattern).search
        except re.error:
            match = lambda line: pattern in line  # noqa: E731  (not a regex: literal)
        hits = [f"{path}:{number}: {line}" for path, text in self.files.items()
                for number, line in enumerate(text.splitlines(), 1) if match(line)]
        return "\n".join(hits[:40] + ([f"... {len(hits) - 40} more"] if len(hits) > 40 else [])) \
            or "no matches"


def make_task(tokenizer, seed: int, index: int, n_tokens: int, n_files: int,
              n_questions: int = 1, scripted_reads: bool = False) -> Task:
    """A repository of `n_files` modules, ~`n_tokens` tokens, and questions about it.
    Units of three functions (compute_ adds a constant, a helper, a summarize_ calling
    another unit's helper) go round-robin into the modules until the size is reached.
    One question asks without saying where; several name their function's file, the
    k-th in the k-th file (round-robin): the first of each file asks for it to be read
    (or, with `scripted_reads`, the harness writes that call and its result, as a client
    that adds files to the chat does), a later one says it was read above."""
    rng = random.Random(f"tool-agent-{seed}-{index}")
    paths = [f"pkg/{name}.py" for name in rng.sample(MODULES, n_files)]
    blocks = {path: [f'"""{path[4:-3].capitalize()} figures."""\n'] for path in paths}
    pairs = [f"{a}_{b}" for a in WORDS for b in WORDS if a != b]
    names = iter(rng.sample(pairs, len(pairs)))
    units, size = [], sum(len(tokenizer.encode(b[0])) for b in blocks.values())
    while size < n_tokens:  # a unit's size with its own name as the callee: near enough
        units.append((next(names), rng.randrange(2, 10), rng.randrange(2, 10)))
        size += len(tokenizer.encode(_unit(units[-1][0], units[-1][0], units[-1][1], 500,
                                           units[-1][2]))) + 2
    constants = rng.sample(range(101, 10_000), len(units))
    words = [u[0] for u in units]
    callers = words[1:] + words[:1]  # unit i's summarize_ calls unit i+1's helper
    order = list(range(len(units)))
    rng.shuffle(order)
    for slot, i in enumerate(order):
        word, scale, factor = units[i]
        blocks[paths[slot % n_files]].append(_unit(word, callers[i], scale, constants[i], factor))
    in_file = [[i for slot, i in enumerate(order) if slot % n_files == f] for f in range(n_files)]
    questions = []
    for k in range(n_questions):
        path = paths[k % n_files]
        pick = rng.choice(in_file[k % n_files]) if n_questions > 1 else rng.randrange(len(units))
        if (index + k) % 2 == 0:
            question, answer, kind = (f"What constant does `compute_{words[pick]}` add to "
                                      "its result?", str(constants[pick]), "constant")
        else:
            question, answer, kind = (f"Which function calls `helper_{callers[pick]}`?",
                                      f"summarize_{words[pick]}", "caller")
        read = path if scripted_reads and k < n_files else None
        if n_questions > 1 and k < n_files:
            question = f"{question} It is in `{path}`: I will show it to you." \
                if scripted_reads else \
                f"Read `{path}` with the read_file tool, then answer: {question}"
        elif n_questions > 1:
            question = f"{question} The answer is in `{path}`, which you read above."
        questions.append((question, answer, kind, read))
    return Task({p: "\n\n".join(b) for p, b in blocks.items()}, questions)


def _unit(word: str, callee: str, scale: int, constant: int, factor: int) -> str:
    return (f"def compute_{word}(value):\n"
            f'    """Scale the {word} reading and shift it into range."""\n'
            f"    scaled = value * {scale}\n"
            f"    return scaled + {constant}\n\n\n"
            f"def helper_{word}(items):\n"
            f'    """Add up the {word} values."""\n'
            f"    total = 0\n"
            f"    for item in items:\n"
            f"        total += item\n"
            f"    return total\n\n\n"
            f"def summarize_{word}(items):\n"
            f'    """Combine the {word} records into one figure."""\n'
            f"    subtotal = helper_{callee}(items)\n"
            f"    return subtotal * {factor}\n")


def read_reply(text: str, tokenizer) -> tuple:
    """(content, calls, invalid calls) of a whole reply, read by the engine's parser."""
    parser = OutputParser(tokenizer, parse_tools=True, tools=TOOLS)
    content, calls, invalid = [], [], []
    for event in parser.feed(text) + parser.finish(None):
        if isinstance(event, TextEvent):
            content.append(event.text)
        elif isinstance(event, ToolCallEvent):
            if event.error is None:
                calls.append({"name": event.name, "args": json.loads(event.args)})
            else:
                invalid.append({"name": event.name, "error": event.error})
    return "".join(content).strip(), calls, invalid


def _as_mlx_lm_server(messages: list) -> list:
    """The history as mlx-lm's server hands it to the template: call arguments parsed."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = [{**c, "function": {**c["function"],
                                        "arguments": json.loads(c["function"]["arguments"])}}
                     for c in message["tool_calls"]]
            message = {**message, "tool_calls": calls}
        out.append(message)
    return out


def agent_loop(ask, tokenizer, task: Task, args, limits) -> tuple:
    """The loop: `ask(messages, limits)` -> a turn's row (with its reply); valid calls
    run, invalid ones get their error back, a reply without a call answers the question
    asked, and the next question follows in the same conversation."""
    messages = [{"role": "system", "content": args.system}] if args.system else []
    turns, answers = [], []
    counts = dict(calls=0, valid=0, invalid=0, fenced=0, recovered=0)
    started = time.perf_counter()
    for number, (question, expected, _, read) in enumerate(task.questions, 1):
        messages.append({"role": "user", "content": question if read else ASK + question})
        if read:  # the harness's call, as if the model had made it
            call = {"name": "read_file", "args": {"path": read}}
            messages += [_calling("", [call]),
                         {"role": "tool", "content": task.run_tool("read_file", call["args"])}]
        answer = None
        for turn in range(args.turns):
            row = ask(messages, limits)
            content, calls, invalid = read_reply(row["reply"], tokenizer)
            fenced = not calls and not invalid and bool(FENCED.search(content))
            # calls the parser read back from fenced or bare JSON, not the template's markup
            recovered = bool(calls) and tokenizer.tool_call_start not in row["reply"] \
                and bool(FENCED.search(row["reply"]))
            counts["calls"] += len(calls) + len(invalid) + fenced
            counts["valid"] += len(calls)
            counts["invalid"] += len(invalid)
            counts["fenced"] += fenced
            counts["recovered"] += len(calls) if recovered else 0
            named = FENCED_NAME.search(content) if fenced else None
            row.update(question=number, turn=turn + 1,
                       calls=[{"name": c["name"], "args": c["args"]} for c in calls],
                       fenced_call=named.group(1) if named else None,
                       invalid=[c["error"] for c in invalid],
                       coverage=_coverage(row["reuse"]),
                       action="fenced call (not recovered)" if fenced else
                       "fenced call (recovered)" if recovered else
                       "tool calls" if calls or invalid else "answer")
            tool_started = time.perf_counter()
            if not calls and not invalid:
                answer = content
                messages.append({"role": "assistant", "content": content})
            elif calls:
                messages.append(_calling(content, calls))
                for call in calls:
                    messages.append({"role": "tool",
                                     "content": task.run_tool(call["name"], call["args"])})
                    time.sleep(args.tool_seconds)
            else:  # only invalid calls: the model sees what it wrote and why it failed
                messages.append({"role": "assistant", "content": row["reply"]})
            if invalid:
                errors = "; ".join(c["error"] for c in invalid)
                messages.append({"role": "user", "content": f"A tool call could not be run: "
                                 f"{errors}. Call tools as the system prompt shows."})
            row["tool_s"] = time.perf_counter() - tool_started
            turns.append(row)
            if answer is not None:
                break
        right = answer is not None and \
            re.search(rf"\b{re.escape(expected)}\b", answer) is not None
        answers.append(dict(answered=answer is not None, right=right, answer_text=answer))
        turns[-1]["right"] = right
    loop = dict(counts, turns=len(turns), questions=len(answers),
                answered=sum(a["answered"] for a in answers),
                right=sum(a["right"] for a in answers), answers=answers,
                wall=time.perf_counter() - started)
    return turns, loop


def _calling(content: str, calls: list) -> dict:
    """The assistant message of `calls` ({"name", "args"}), as a client sends it back."""
    return {"role": "assistant", "content": content, "tool_calls": [
        {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
         "function": {"name": c["name"], "arguments": json.dumps(c["args"])}} for c in calls]}


def _coverage(reuse: str):
    """The reuse gate's coverage in the report's text, None where no stored view was met."""
    found = re.search(r"coverage (\d+\.\d+)|covers (\d+\.\d+)", reuse or "")
    return float(found.group(1) or found.group(2)) if found else None


def run(args) -> tuple:
    tokenizer = load_tokenizer(Path(args.target))
    shapes = [shape_of(load(path, lazy=True)[0]) for path in (args.target, args.draft)]
    limits = argparse.Namespace(step_size=args.step_size, reply_tokens=args.reply_tokens,
                                ignore_eos=False)
    # the warm-up: one short turn of another task (compiled kernels, the template's head cached)
    warm_args = argparse.Namespace(**{**vars(args), "turns": 1, "tool_seconds": 0})
    warm_limits = argparse.Namespace(**{**vars(limits), "reply_tokens": 8})
    warm_task = make_task(tokenizer, args.seed, 10_000, args.tokens, args.files)
    turn_rows, loops = [], []
    for index in range(args.tasks):
        task = make_task(tokenizer, args.seed, index, args.tokens, args.files, args.questions,
                         args.scripted_reads)
        rotate = index % len(args.methods)
        for name in args.methods[rotate:] + args.methods[:rotate]:
            if METHODS[name] is None:
                model, _ = load_model(args.target)
                store = LRUPromptCache(16)

                def ask(messages, limits, model=model, store=store):
                    started = time.perf_counter()
                    tokens = tokenizer.apply_chat_template(
                        _as_mlx_lm_server(messages), tools=TOOLS, add_generation_prompt=True)
                    return mlx_lm_turn(model, tokenizer, store, tokens, limits, started)

                agent_loop(ask, tokenizer, warm_task, warm_args, warm_limits)
                turns, loop = agent_loop(ask, tokenizer, task, args, limits)
                del model, store, ask
                mx.clear_cache()
            else:
                with Engine(model=args.target, draft=args.draft,
                            **METHODS[name]["engine"]) as engine:
                    def ask(messages, limits, engine=engine, request=METHODS[name]["request"]):
                        return engine_turn(engine, request, messages, TOOLS, limits)

                    agent_loop(ask, tokenizer, warm_task, warm_args, warm_limits)
                    while engine.stats()["densify"].pending:  # idle before the task
                        time.sleep(0.05)
                    turns, loop = agent_loop(ask, tokenizer, task, args, limits)
            for row in turns:
                row.update(method=name, task=index, mac_projected=mac_turn_s(*shapes, row))
                turn_rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k != "reply"}), flush=True)
            loop.update(method=name, task=index, kinds=[q[2] for q in task.questions],
                        asked=[q[0] for q in task.questions],
                        expected=[q[1] for q in task.questions],
                        final_prompt_tokens=turns[-1]["prompt_tokens"],
                        model_s=sum(r["wall"] for r in turns),
                        ttft_s=sum(r["ttft"] for r in turns),
                        draft_tokens=sum(r["draft_tokens"] for r in turns),
                        target_tokens=sum(r["target_tokens"] for r in turns),
                        mac_projected_s=sum(r["mac_projected"]["wall"] for r in turns))
            loops.append(loop)
            print(json.dumps(loop), flush=True)
    return turn_rows, loops


def summary(loops: list, methods: list) -> dict:
    """Per method: means per loop, call and answer counts, ratios to mlx-lm and dense
    (a method's mean over the other's: below 1 is faster)."""
    out = {}
    for name in methods:
        mine = [loop for loop in loops if loop["method"] == name]
        calls = sum(loop["calls"] for loop in mine)
        out[name] = {
            "loops": len(mine),
            "wall_s": statistics.mean(loop["wall"] for loop in mine),
            "model_s": statistics.mean(loop["model_s"] for loop in mine),
            "ttft_s": statistics.mean(loop["ttft_s"] for loop in mine),
            "mac_projected_s": statistics.mean(loop["mac_projected_s"] for loop in mine),
            "turns": statistics.mean(loop["turns"] for loop in mine),
            "final_prompt_tokens": statistics.mean(loop["final_prompt_tokens"] for loop in mine),
            "draft_tokens": statistics.mean(loop["draft_tokens"] for loop in mine),
            "target_tokens": statistics.mean(loop["target_tokens"] for loop in mine),
            "calls": calls, "valid": sum(loop["valid"] for loop in mine),
            "invalid": sum(loop["invalid"] for loop in mine),
            "fenced": sum(loop["fenced"] for loop in mine),
            "recovered": sum(loop.get("recovered", 0) for loop in mine),
            "valid_rate": sum(loop["valid"] for loop in mine) / calls if calls else None,
            "right": sum(loop["right"] for loop in mine),
            "questions": sum(loop.get("questions", 1) for loop in mine),
        }
    for base in ("mlx-lm", "dense"):
        if base in out:
            for name in methods:
                for key in ("wall_s", "mac_projected_s"):
                    out[name][f"{key}_to_{base}"] = out[name][key] / out[base][key]
    return out


def tables(result: dict) -> str:
    """Markdown: the summary per method, then every turn."""
    s, methods = result["summary"], list(result["summary"])
    ratio = lambda row, key: f"{row[key]:.2f}" if key in row else "-"  # noqa: E731
    lines = ["| method | loops | wall / loop s | / mlx-lm | / dense | turns | calls | valid "
             "| of them recovered | fenced (not recovered) | right | final prompt tok "
             "| target tok | draft tok | Mac projected s | projected / mlx-lm |",
             "| --- |" + " --- |" * 15]
    for name in methods:
        row = s[name]
        rate = "-" if row["valid_rate"] is None else f"{row['valid']}/{row['calls']}"
        lines.append(
            f"| {name} | {row['loops']} | {row['wall_s']:.1f} | {ratio(row, 'wall_s_to_mlx-lm')} "
            f"| {ratio(row, 'wall_s_to_dense')} | {row['turns']:.1f} | {row['calls']} | {rate} "
            f"| {row.get('recovered', 0)} | {row['fenced']} | {row['right']}/{row.get('questions', row['loops'])} | {row['final_prompt_tokens']:.0f} "
            f"| {row['target_tokens']:.0f} | {row['draft_tokens']:.0f} "
            f"| {row['mac_projected_s']:.2f} | {ratio(row, 'mac_projected_s_to_mlx-lm')} |")
    lines += ["", "| task | method | question | turn | prompt | draft | target | TTFT s "
              "| decode s | action | calls | reuse | coverage |", "| --- |" + " --- |" * 12]
    for row in result["turns"]:
        calls = ", ".join(f"{c['name']}({', '.join(map(str, c['args'].values()))})"
                          for c in row["calls"]) or "; ".join(row["invalid"])[:60]
        if row.get("fenced_call"):
            calls = f"fenced: {row['fenced_call']}"
        reuse = (row["reuse"] or "-").replace("|", "/")[:70]
        coverage = "-" if row["coverage"] is None else f"{row['coverage']:.2f}"
        action = row["action"] + {True: " (right)", False: " (wrong)"}.get(row.get("right"), "")
        lines.append(f"| {row['task']} | {row['method']} | {row.get('question', 1)} "
                     f"| {row['turn']} | {row['prompt_tokens']} "
                     f"| {row['draft_tokens']} | {row['target_tokens']} | {row['ttft']:.2f} "
                     f"| {row['decode']:.2f} | {action} | {calls} | {reuse} | {coverage} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(parser)
    add_run_arguments(parser, lengths=[2000], repeats=4, one_length=True,
                      what="the repository's size in tokens",
                      repeats_what="tasks (loops), each a repository and its questions")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--files", type=int, default=3, help="modules in the repository")
    parser.add_argument("--questions", type=int, default=1,
                        help="questions per loop, one after another in one conversation")
    parser.add_argument("--scripted-reads", action="store_true",
                        help="with --questions: the harness reads each question's file into "
                        "the conversation (a read_file call and its result) before the model's turn")
    parser.add_argument("--turns", type=int, default=8, help="requests per question at most")
    parser.add_argument("--reply-tokens", type=int, default=256)
    parser.add_argument("--system", help="a system prompt (default: none, the template's own)")
    parser.add_argument("--tool-seconds", type=float, default=0.0, help="sleep per tool call")
    parser.add_argument("--step-size", type=int, default=None,
                        help="mlx-lm's prefill unit (default: the engine's, 256 CPU / 2048 GPU)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--table", help="print the tables of a saved --json run and exit")
    args = parser.parse_args(argv)
    if args.table:
        print(tables(json.loads(Path(args.table).read_text())))
        return 0
    args.target, args.draft = model_folders(args)
    args.target, args.draft = args.target or str(DEMO_TARGET), args.draft or str(DEMO_DRAFT)
    args.tokens, args.tasks = args.lengths[0], args.repeats
    if not 1 <= args.files <= len(MODULES):
        parser.error(f"--files must be in [1, {len(MODULES)}]")
    args.step_size = args.step_size or default_step_size()
    started = time.perf_counter()
    turns, loops = run(args)
    result = {"summary": summary(loops, args.methods), "loops": loops, "turns": turns,
              "mac_reference": MAC_REFERENCE, "args": vars(args),
              "run_s": time.perf_counter() - started}
    print(json.dumps(result["summary"], indent=2))
    print(tables(result))
    write_json(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
