"""Many agent sessions on one server (#62): N concurrent sessions replayed against a
server's OpenAI (`/v1/chat/completions`), Anthropic (`/v1/messages`) and Responses
(`/v1/responses`) endpoints, side by side against `specprefill-engine serve` and
`mlx_lm.server` (the OpenAI endpoint only: the one it has) on the same model and traffic.

Sessions: session i is a client kind in turn (claude-code over the Anthropic API, codex
over Responses, opencode and aider over chat completions), its system prompt and tool
definitions taken from that CLI's captured request (`tests/fixtures/clients/`) and
scaled to `--system-tokens` (cut, or lengthened with project notes), shared by every
session of its kind as users' agents share them. A session opens with a task, then
each turn appends a scripted assistant turn of 1-3 tool calls (parallel ones from the
second turn) and their results (`--tool-result-tokens`: files and command output of
that many tokens), after `--tool-seconds` of tool time; replies are `--reply-tokens`
long at most (max_tokens), greedy (temperature 0), streamed as the CLIs stream. The
history is scripted (the model's replies are recorded, not fed back), so every server
and the solo replay see the same prompts. Events on a session's second request, by
j = i + i // (kinds): j % 4 == 0 a retried request (sent again once its reply has come,
the retry header set), 1 a cancelled stream (closed after its first token, then sent
again), 2 a client that disconnects mid-stream (gone once the response's headers came,
during the prefill, then sent again); where j is odd the system prompt ends with a line
that changes on every request (as Claude Code's attribution header; Anthropic sessions
also send Claude Code's `x-anthropic-billing-header` block first, with a changing
`cch`, which serve leaves out). The last request of a session with tools requires a
tool call (`tool_choice`; mlx_lm.server ignores it).

Reported per session and overall: requests, failures (a non-2xx other than a clear
4xx, one saying the request alone exceeds the server's memory or context: the replay
sends only valid requests; a malformed stream or reply, a tool call whose name or
arguments do not parse, a tool call left in the text, a reply that is a stray template token such as
`</tool_response>` or `<|im_end|>`, a special token in the text), time to first token
p50 / p99 (first text or tool-call delta), decode tokens/s, prompt tokens served from
cache (OpenAI `usage.prompt_tokens_details.cached_tokens`, Anthropic
`cache_read_input_tokens`, Responses `input_tokens_details.cached_tokens`; None where
the server reports none) as a share of the prompt on a session's first request and of
the previous request's prompt on later ones, and the server's peak memory (RSS of its
process tree, sampled every 0.25 s) and whether its log holds a traceback.
`--check-solo` replays every session alone (one at a time, on a fresh server of each
kind) and compares each answer with the loaded run's: greedy dense sessions must
answer as they do alone.

    # this CPU: the demo pair, both servers started here, budgets below the sessions' KV
    python benchmarks/sessions.py --small --sessions 4 8 16 --servers serve serve-dense \\
        mlx-lm --prefix-cache-bytes 20000000 --disk-cache-gb 0.02 --check-solo \\
        --json docs/results/sessions-cpu-demo.json
    # GPU: a random Qwen3-8B shape, 10-30K of system prompt and tools
    python benchmarks/sessions.py --target-shape qwen3-8b --sessions 8 16 32 --json out.json
    # a server already running (its OpenAI endpoint only with --api openai)
    python benchmarks/sessions.py --url http://127.0.0.1:8000 --sessions 4
"""

import argparse
import asyncio
import json
import math
import os
import shlex
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import httpx

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "clients"
DEMO_TARGET = ROOT / "specprefill_engine" / "assets" / "demo-target"
DEMO_DRAFT = ROOT / "specprefill_engine" / "assets" / "demo-draft"
# client kind -> its captured request and the API it speaks
KINDS = {
    "claude-code": ("claude-code/01-v1-messages.json", "anthropic"),
    "codex": ("codex/01-v1-responses.json", "responses"),
    "opencode": ("opencode/02-v1-chat-completions.json", "openai"),
    "aider": ("aider/01-v1-chat-completions.json", "openai"),
}
PATHS = {"openai": "/v1/chat/completions", "anthropic": "/v1/messages",
         "responses": "/v1/responses"}
EVENTS = ("retry", "cancel", "disconnect", None)  # by session index % 4
BILLING = "x-anthropic-billing-header: cc_version=2.1.197.26b; cc_entrypoint=sdk-cli; cch={};"
# a reply that begins with one of these, or is nothing else, is a stray template token
MARKERS = re.compile(r"</?tool_response>|</?tool_call>|<\|[A-Za-z_]+\|>|</?think>")
SPECIAL = re.compile(r"<\|[A-Za-z_]+\|>")
WORDS = ("tariff margin parcel rebate quota beacon cargo depot freight harbor invoice "
         "kernel lattice meter orbit pallet quarry rotor signal tensor vector voltage "
         "wafer yield zenith anchor bridge canal dial ember flux gauge hinge ingot joist "
         "keel lever mantle nozzle piston radius sprocket tether valve welder axle bolt").split()
CALL_TOKENS = 64  # max_tokens at least, where a call is required (a cut call is no call)
BLAS = ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
        "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3")
START_SECONDS = 900  # a server's start: loading, and serve's draft check on a new pair
# the 4xx a valid request may get: it alone exceeds the server's KV memory or the
# model's context (serve's messages; the Anthropic shape carries no code)
BUDGET_ERRORS = re.compile(r"GB of KV memory|the model's context|fit the context of")
SMALL = dict(system_tokens=600, tool_result_tokens=[60, 300], reply_tokens=[16, 48], turns=3,
             tool_seconds=0.2, stagger=0.3)
DEFAULTS = dict(system_tokens=16000, tool_result_tokens=[200, 10000], reply_tokens=[50, 500],
                turns=5, tool_seconds=1.0, stagger=1.0)


def is_clear_4xx(status: int, raw: str) -> bool:
    """An error answer the replay accepts: a 4xx in the API's shape saying the request
    alone exceeds the server's memory or context. The replay sends only valid requests,
    so any other 4xx refused one the server should have served."""
    try:
        error = json.loads(raw)
    except ValueError:
        return False
    detail = error.get("error") if isinstance(error, dict) else None
    if not (400 <= status < 500 and isinstance(detail, dict)):
        return False
    return detail.get("code") == "memory_budget_exceeded" or \
        bool(BUDGET_ERRORS.search(str(detail.get("message", ""))))


# --- the sessions' traffic ------------------------------------------------------------

def client_shape(kind: str) -> tuple[str, list]:
    """The kind's captured system prompt and tools (chat completions' tool shape)."""
    body = json.loads((FIXTURES / KINDS[kind][0]).read_text())["body"]
    if kind == "claude-code":
        system = "\n".join(b["text"] for b in body["system"]
                           if not b["text"].startswith("x-anthropic-billing-header"))
        tools = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}}
            for t in body["tools"]]
    elif kind == "codex":
        system = "\n\n".join(part["text"] for item in body["input"][:2]
                             for part in item["content"])
        tools = [{"type": "function", "function": {
            "name": t["name"], "description": t.get("description", ""),
            "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
            for t in body["tools"] if t.get("type") == "function" and t.get("name")]
    else:
        system = body["messages"][0]["content"]
        tools = body.get("tools", [])
    return system, tools


def count(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def notes(rng: random.Random, tokenizer, tokens: int) -> str:
    """Project notes of about `tokens` tokens (what a CLAUDE.md / AGENTS.md adds)."""
    lines, size = ["", "# Project notes"], 0
    while size < tokens:
        a, b, c = rng.sample(WORDS, 3)
        line = (f"- In `pkg/{a}.py`, `{b}_{c}()` must keep the {a} units; run "
                f"`pytest tests/test_{a}.py -k {c}` after changing it ({rng.randrange(10, 999)}).")
        lines.append(line)
        size += count(tokenizer, line) + 1
    return "\n".join(lines)


def scaled_shape(kind: str, tokenizer, tokens: int) -> tuple[str, list]:
    """The kind's system prompt and tools scaled to about `tokens` tokens: tools dropped
    from the end and the prompt cut where too long, project notes added where short."""
    system, tools = client_shape(kind)
    tool_size = lambda: count(tokenizer, json.dumps(tools)) if tools else 0  # noqa: E731
    while tools and tool_size() > 0.7 * tokens and len(tools) > 1:
        tools = tools[:-1]
    room = max(64, tokens - tool_size())
    ids = tokenizer.encode(system, add_special_tokens=False)
    if len(ids) > room:
        system = tokenizer.decode(ids[:room])
    elif len(ids) < room:
        system += notes(random.Random(f"notes-{kind}"), tokenizer, room - len(ids))
    return system, tools


def tool_output(rng: random.Random, tokenizer, tokens: int, path: str) -> str:
    """A file read or a command's output of about `tokens` tokens."""
    lines, size, n = [f"# {path}"], 0, 0
    while size < tokens:
        a, b = rng.sample(WORDS, 2)
        n += 1
        block = (f"def {a}_{b}_{n}(items):\n    \"\"\"Add up the {a} {b} values.\"\"\"\n"
                 f"    total = {rng.randrange(100, 9999)}\n    for item in items:\n"
                 f"        total += item.{b}\n    return total\n")
        lines.append(block)
        size += count(tokenizer, block) + 1
    return "\n".join(lines)


def arguments_for(tool: dict, rng: random.Random, path: str) -> dict:
    """Arguments a call of `tool` could carry: its required fields, filled by type."""
    schema = tool["function"].get("parameters") or {}
    props = schema.get("properties") or {}
    out = {}
    for name in schema.get("required") or list(props)[:1]:
        kind = (props.get(name) or {}).get("type", "string")
        kind = kind[0] if isinstance(kind, list) else kind
        out[name] = {"integer": rng.randrange(1, 50), "number": 1.5, "boolean": False,
                     "array": [], "object": {}}.get(kind, path if "path" in name or "file" in name
                                                    else f"grep -n {rng.choice(WORDS)} {path}")
    return out


def make_session(index: int, args, tokenizer, shapes: dict) -> dict:
    """Session `index`'s requests, all known up front (the history is scripted)."""
    kinds = args.kinds
    kind = kinds[index % len(kinds)]
    system, tools = shapes[kind]
    rng = random.Random(f"session-{args.seed}-{index}")
    # events and the header by index, shifted each round of kinds so that every kind
    # meets every event and both header states
    round_ = index // len(kinds)
    event = EVENTS[(index + round_) % len(EVENTS)]
    header = (index + round_) % 2 == 1
    context = args.context - max(args.reply_tokens) - 64
    task = (f"Session {index}: the tests in `pkg/{rng.choice(WORDS)}.py` fail since the last "
            f"change to `{rng.choice(WORDS)}_{rng.choice(WORDS)}()`. Find out why and fix it.")
    messages = [{"role": "user", "content": task}]
    requests = []
    usable = [t for t in tools if (t["function"].get("parameters") or {}).get("type") == "object"]
    base = count(tokenizer, system) + count(tokenizer, json.dumps(tools)) + 64
    size = base + count(tokenizer, task)
    for turn in range(args.turns):
        if turn:
            calls = 1 if turn == 1 else rng.randint(2, 3)  # parallel calls from turn 2
            paths = [f"pkg/{rng.choice(WORDS)}_{turn}_{c}.py" for c in range(calls)]
            lo, hi = args.tool_result_tokens
            sizes = [int(math.exp(rng.uniform(math.log(lo), math.log(hi)))) for _ in paths]
            room = context - size - 40 * calls
            if room < calls * lo:
                break  # the context is full: the session ends here
            sizes = [max(20, min(s, room // calls)) for s in sizes]
            outputs = [tool_output(rng, tokenizer, s, p) for s, p in zip(sizes, paths)]
            if usable:
                picked = [rng.choice(usable) for _ in paths]
                ids = [f"call_{index}_{turn}_{c}" for c in range(calls)]
                messages.append({"role": "assistant", "content": "Let me look.", "tool_calls": [
                    {"id": i, "type": "function", "function": {
                        "name": t["function"]["name"],
                        "arguments": json.dumps(arguments_for(t, rng, p))}}
                    for i, t, p in zip(ids, picked, paths)]})
                messages += [{"role": "tool", "tool_call_id": i, "content": o}
                             for i, o in zip(ids, outputs)]
            else:  # aider: files come as a user message
                messages.append({"role": "assistant", "content": "Please add " + ", ".join(
                    paths) + " to the chat."})
                messages.append({"role": "user", "content": "I added these files to the chat:\n\n"
                                 + "\n\n".join(outputs)})
            size += sum(sizes) + 40 * calls
        lo, hi = args.reply_tokens
        last = turn == args.turns - 1 or context - size < 2 * args.tool_result_tokens[0]
        requests.append({"turn": turn, "tool_choice": "required" if last and usable else None, "messages": json.loads(json.dumps(messages)),
                         "max_tokens": max(rng.randint(lo, hi), CALL_TOKENS if last and usable
                                           else 0), "after_tool": turn > 0,
                         "event": event if turn == 1 else None,
                         "tool_seconds": args.tool_seconds * rng.uniform(0.5, 1.5) if turn else 0,
                         "header": f"x-request-context: cch={rng.getrandbits(20):05x}; "
                                   f"request={turn}" if header else None,
                         "billing": BILLING.format(f"{rng.getrandbits(20):05x}")})
    session = {"index": index, "kind": kind, "api": KINDS[kind][1], "system": system,
               "tools": tools, "header": header, "event": event, "requests": requests}
    previous = None
    for request in requests:  # the prompt as the chat template renders it
        ids = prompt_ids(tokenizer, session, request)
        request["prompt_ids"] = len(ids)
        # as serve renders it: the header line is a metadata line it leaves out
        request["served_ids"] = len(prompt_ids(tokenizer, session, {**request, "header": None}))
        request["shared_previous"] = common(ids, previous) if previous else 0
        previous = ids
    return session


def prompt_ids(tokenizer, session: dict, request: dict) -> list:
    body = body_for(session, request, "openai", "")
    return tokenizer.apply_chat_template(body["messages"], tools=body.get("tools") or None,
                                         add_generation_prompt=True, tokenize=True)


def common(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def body_for(session: dict, request: dict, api: str, model: str) -> dict:
    """The request as the kind's CLI sends it through `api`."""
    system = session["system"] + (f"\n{request['header']}" if request["header"] else "")
    messages, tools = request["messages"], session["tools"]
    if api == "openai":
        body = {"model": model, "messages": [{"role": "system", "content": system}] + messages,
                "max_tokens": request["max_tokens"], "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        if tools:
            body["tools"] = tools
        if request.get("tool_choice"):
            body["tool_choice"] = "required"
        return body
    if api == "anthropic":
        out = []
        for m in messages:
            if m["role"] == "assistant":
                blocks = [{"type": "text", "text": m["content"]}] if m["content"] else []
                blocks += [{"type": "tool_use", "id": "toolu_" + c["id"], "name":
                            c["function"]["name"], "input": json.loads(c["function"]["arguments"])}
                           for c in m.get("tool_calls") or []]
                out.append({"role": "assistant", "content": blocks})
            elif m["role"] == "tool":
                block = {"type": "tool_result", "tool_use_id": "toolu_" + m["tool_call_id"],
                         "content": m["content"]}
                if out and out[-1]["role"] == "user" and isinstance(out[-1]["content"], list) \
                        and out[-1]["content"][-1].get("type") == "tool_result":
                    out[-1]["content"].append(block)
                else:
                    out.append({"role": "user", "content": [block]})
            else:
                out.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
        blocks = [{"type": "text", "text": request["billing"]},
                  {"type": "text", "text": session["system"], "cache_control": {"type": "ephemeral"}}]
        if request["header"]:
            blocks.append({"type": "text", "text": request["header"]})
        body = {"model": model, "system": blocks, "messages": out, "stream": True,
                "max_tokens": request["max_tokens"], "temperature": 0}
        if tools:
            body["tools"] = [{"name": t["function"]["name"], "description":
                              t["function"].get("description", ""),
                              "input_schema": t["function"]["parameters"]} for t in tools]
        if request.get("tool_choice"):
            body["tool_choice"] = {"type": "any"}
        return body
    items = [{"type": "message", "role": "developer",
              "content": [{"type": "input_text", "text": system}]}]
    for m in messages:
        if m["role"] == "assistant":
            if m["content"]:
                items.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": m["content"]}]})
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m.get("tool_calls") or []]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                          "output": m["content"]})
        else:
            items.append({"type": "message", "role": "user",
                          "content": [{"type": "input_text", "text": m["content"]}]})
    body = {"model": model, "input": items, "stream": True, "store": False,
            "max_output_tokens": request["max_tokens"], "temperature": 0,
            "parallel_tool_calls": True}
    if tools:
        body["tools"] = [{"type": "function", "name": t["function"]["name"],
                          "description": t["function"].get("description", ""),
                          "parameters": t["function"]["parameters"]} for t in tools]
    if request.get("tool_choice"):
        body["tool_choice"] = "required"
    return body


# --- one request, streamed -------------------------------------------------------------

class Reply:
    """What a streamed reply said, read by its API's events."""

    def __init__(self, api: str):
        self.api, self.text, self.calls, self.usage = api, [], {}, {}
        self.finish, self.done, self.error = None, False, None

    def content(self, data: dict) -> bool:
        """Read one event; True when it carried content (text or a tool call)."""
        if self.api == "openai":
            if "error" in data:
                self.error = str(data["error"])[:300]
            if data.get("usage"):
                u = data["usage"]
                self.usage = {"prompt": u.get("prompt_tokens"), "completion":
                              u.get("completion_tokens"), "cached":
                              (u.get("prompt_tokens_details") or {}).get("cached_tokens")}
            seen = False
            for choice in data.get("choices") or []:
                delta = choice.get("delta") or {}
                if delta.get("content"):
                    self.text.append(delta["content"])
                    seen = True
                for call in delta.get("tool_calls") or []:
                    slot = self.calls.setdefault(call.get("index", 0), {"name": "", "arguments": ""})
                    fn = call.get("function") or {}
                    slot["name"] += fn.get("name") or ""
                    slot["arguments"] += fn.get("arguments") or ""
                    seen = True
                if choice.get("finish_reason"):
                    self.finish = choice["finish_reason"]
            return seen
        kind = data.get("type", "")
        if self.api == "anthropic":
            if kind == "content_block_start":
                block = data.get("content_block") or {}
                if block.get("type") == "tool_use":
                    self.calls[data.get("index", 0)] = {"name": block.get("name", ""),
                                                        "arguments": ""}
                    return True
            elif kind == "content_block_delta":
                delta = data.get("delta") or {}
                if delta.get("type") == "text_delta":
                    self.text.append(delta.get("text", ""))
                    return bool(delta.get("text"))
                if delta.get("type") == "input_json_delta":
                    self.calls.setdefault(data.get("index", 0), {"name": "", "arguments": ""})[
                        "arguments"] += delta.get("partial_json", "")
                return delta.get("type") in ("input_json_delta", "thinking_delta")
            elif kind == "message_delta":
                u = data.get("usage") or {}
                cached = u.get("cache_read_input_tokens")
                self.usage = {"prompt": (u.get("input_tokens") or 0) + (cached or 0),
                              "completion": u.get("output_tokens"), "cached": cached}
                self.finish = (data.get("delta") or {}).get("stop_reason")
            elif kind == "message_stop":
                self.done = True
            elif kind == "error":
                self.error = str(data.get("error"))[:300]
            return False
        if kind == "response.output_text.delta":
            self.text.append(data.get("delta", ""))
            return bool(data.get("delta"))
        if kind in ("response.function_call_arguments.delta", "response.reasoning_text.delta"):
            return True
        if kind == "response.output_item.done":
            item = data.get("item") or {}
            if item.get("type") == "function_call":
                self.calls[data.get("output_index", len(self.calls))] = {
                    "name": item.get("name", ""), "arguments": item.get("arguments", "")}
        elif kind in ("response.completed", "response.incomplete"):
            u = (data.get("response") or {}).get("usage") or {}
            self.usage = {"prompt": u.get("input_tokens"), "completion": u.get("output_tokens"),
                          "cached": (u.get("input_tokens_details") or {}).get("cached_tokens")}
            self.finish, self.done = kind.split(".")[1], True
        elif kind in ("response.failed", "error"):
            self.error = json.dumps(data)[:300]
        return False


def problems(reply: Reply, tool_names: set, after_tool: bool) -> list:
    """What is wrong with a finished reply (empty: nothing)."""
    found = []
    if reply.error:
        found.append(f"error in the stream: {reply.error}")
    if not reply.done:
        found.append("malformed: the stream ended without its final event")
    if reply.usage.get("completion") is None:
        found.append("malformed: no usage")
    text = "".join(reply.text)
    for call in reply.calls.values():
        try:
            arguments = json.loads(call["arguments"] or "{}")
            if not isinstance(arguments, dict):
                raise ValueError("not an object")
        except ValueError:
            found.append(f"unparseable tool call arguments: {call['arguments'][:80]!r}")
        if call["name"] not in tool_names:
            found.append(f"tool call of an undeclared tool: {call['name']!r}")
    if "<tool_call>" in text:
        found.append("tool call left in the text")
    stripped = text.strip()
    if stripped and (MARKERS.match(stripped) or not MARKERS.sub("", stripped).strip()):
        found.append(f"stray template token{' after a tool result' if after_tool else ''}: "
                     f"{stripped[:40]!r}")
    elif SPECIAL.search(text):
        found.append(f"special token in the text: {SPECIAL.search(text).group()!r}")
    return found


def notes_on(record: dict) -> list:
    """What is odd about a well-formed reply but not a failure: the model's own words."""
    out = []
    text = record.get("text") or ""
    if MARKERS.search(text):  # plain text in the demo tokenizer: the model wrote it
        out.append("template marker inside the reply")
    if not text.strip() and not record.get("tool_calls"):
        out.append(f"empty reply (finish {record.get('finish')})")
    if record.get("tool_choice") and not record.get("tool_calls"):
        out.append("no tool call where one was required")
    return out


async def send(client: httpx.AsyncClient, url: str, session: dict, request: dict, api: str,
               model: str, mode: str, timeout: float, t0: float) -> dict:
    """One request, streamed; `mode` "full", "cancel" (closed after the first content) or
    "disconnect" (closed once the response's headers came, before any content)."""
    body = body_for(session, request, api, model)
    headers = {"x-stainless-retry-count": "1"} if mode == "retry" else {}
    if api == "anthropic":
        headers["anthropic-version"] = "2023-06-01"
    record = {"session": session["index"], "turn": request["turn"], "attempt": mode,
              "api": api, "status": None, "ttft": None, "wall": None, "start": time.perf_counter() - t0,
              "failures": [], "after_tool": request["after_tool"],
              "prompt_ids": request.get("prompt_ids"), "served_ids": request.get("served_ids"),
              "shared_previous": request.get(
                  "shared_previous"), "shared_other": request.get("shared_other"),
              "tool_choice": request.get("tool_choice"), "header": bool(request["header"])}
    reply, sent, first, last = Reply(api), time.perf_counter(), None, None
    try:
        async with client.stream("POST", url + PATHS[api], json=body, headers=headers,
                                 timeout=timeout) as response:
            record["status"] = response.status_code
            if response.status_code != 200:
                raw = (await response.aread()).decode(errors="replace")
                clear = is_clear_4xx(response.status_code, raw)
                record["body"] = raw[:300]
                if not clear:
                    record["failures"].append(f"HTTP {response.status_code}: {raw[:120]!r}")
                record["clear_4xx"] = clear
                return record
            if mode == "disconnect":
                record["wall"] = time.perf_counter() - sent
                return record  # leaving the block closes the connection mid-stream
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    reply.done = True
                    continue
                try:
                    event = json.loads(data)
                except ValueError:
                    record["failures"].append(f"malformed event: {data[:80]!r}")
                    continue
                report = event.get("specprefill") or (event.get("response") or {}).get("specprefill")
                if isinstance(report, dict):  # serve's report: what reuse chose, and why
                    record["report"] = {k: report.get(k) for k in ("engaged", "reason", "reuse",
                                                                   "kept_tokens", "total_tokens")}
                    timings = event.get("timings") or (event.get("response") or {}).get("timings")
                    if isinstance(timings, dict):  # where the wait went, on the server
                        record["server_timings"] = {k: timings.get(k) for k in (
                            "queue_wait", "prefill", "time_to_first_token")}
                if reply.content(event):
                    last = time.perf_counter()
                    if first is None:
                        first = last
                        # a reply that opens with a call shows nothing before the call's
                        # end: both servers send a call whole, once it parses
                        record["first_kind"] = "text" if "".join(reply.text) else "call"
                        if mode == "cancel":
                            break
    except httpx.HTTPError as error:
        record["failures"].append(f"transport: {type(error).__name__}: {error}"[:200])
        return record
    end = time.perf_counter()
    record.update(wall=end - sent, ttft=first - sent if first else None,
                  text="".join(reply.text),
                  tool_calls=[reply.calls[k] for k in sorted(reply.calls)], finish=reply.finish,
                  prompt_tokens=reply.usage.get("prompt"), cached_tokens=reply.usage.get("cached"),
                  completion_tokens=reply.usage.get("completion"))
    if mode == "cancel":
        return record
    names = {t["function"]["name"] for t in session["tools"]}
    record["failures"] += problems(reply, names, request["after_tool"])
    record["notes"] = notes_on(record)
    tokens = record["completion_tokens"] or 0
    if first and tokens > 1 and last > first:  # a reply that came in one event (a tool
        # call, sent whole by both servers) has no decode rate to read
        record["decode_tok_s"] = (tokens - 1) / (last - first)
    return record


async def run_session(session: dict, url: str, apis: dict, model: str, args, t0: float,
                      delay: float, tool_time: bool = True) -> list:
    """Replay one session: its requests in turn, tool time between them, its event."""
    await asyncio.sleep(delay)
    api = apis.get(session["api"], "openai")
    records = []
    async with httpx.AsyncClient() as client:
        for request in session["requests"]:
            if tool_time and request["tool_seconds"]:
                await asyncio.sleep(request["tool_seconds"])
            event = request["event"]
            if event in ("cancel", "disconnect"):
                records.append(await send(client, url, session, request, api, model, event,
                                          args.request_timeout, t0))
            records.append(await send(client, url, session, request, api, model, "full",
                                      args.request_timeout, t0))
            if event == "retry":
                records.append(await send(client, url, session, request, api, model, "retry",
                                          args.request_timeout, t0))
                first, again = records[-2], records[-1]
                if not first["failures"] and not again["failures"] and answer(first) != answer(again):
                    again["retry_differs"] = True
    return records


def answer(record: dict):
    return (record.get("text"), json.dumps(record.get("tool_calls")))


# --- the servers -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def tree_rss(pid: int) -> int:
    """RSS bytes of `pid` and its descendants (/proc)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            pass
    return total


def computed_copy(model: str, workdir: Path) -> str:
    """The model as serve computes it, for mlx-lm: serve runs float32 on a CPU
    (`loading.default_dtype`; bfloat16 matmuls are slow there), mlx-lm the stored dtype,
    so on a CPU mlx-lm gets a float32 copy of the same weights; elsewhere the folder."""
    import mlx.core as mx
    from mlx_lm.utils import load_model, save_model

    if mx.default_device() != mx.cpu:
        return model
    out = workdir / "mlx-lm-float32"
    if not (out / "config.json").exists():
        weights, _ = load_model(Path(model))
        weights.set_dtype(mx.float32)
        mx.eval(weights.parameters())
        save_model(out, weights)
        for name in os.listdir(model):  # config and tokenizer, as they are
            if not name.endswith(".safetensors") and name != "model.safetensors.index.json" \
                    and os.path.isfile(os.path.join(model, name)):
                shutil.copy(os.path.join(model, name), out / name)
    return str(out)


class Server:
    """A server this run starts on 127.0.0.1: `serve` (defaults), `serve-dense`
    (SpecPrefill never engaged: its threshold past every prompt) or `mlx-lm`; its own
    cache folder, its log in a file, its memory sampled while it runs."""

    def __init__(self, name: str, args, workdir: Path):
        self.name, self.port = name, free_port()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=workdir))
        env = dict(os.environ, SPECPREFILL_CACHE_DIR=str(self.dir / "cache"))
        paths = [str(ROOT), str(ROOT / "integrations")]
        env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")])
        if name == "mlx-lm":
            command = [sys.executable, "-m", "mlx_lm.server", "--model",
                       computed_copy(args.model, workdir),
                       "--port", str(self.port), "--host", "127.0.0.1", "--max-tokens",
                       str(max(args.reply_tokens))]
            if args.prefix_cache_bytes is not None:
                command += ["--prompt-cache-bytes", str(args.prefix_cache_bytes)]
            command += shlex.split(args.mlx_lm_args)
            blas = next((p for p in BLAS if os.path.exists(p)), None)
            if blas and sys.platform.startswith("linux"):  # the BLAS serve loads (_blas.py)
                env.update(LD_PRELOAD=blas, OPENBLAS_THREAD_TIMEOUT="4")
        else:
            command = [sys.executable, "-m", "specprefill_engine.cli", "serve", "--model",
                       args.model, "--port", str(self.port), "--log-level", "warning"]
            if args.draft:
                command += ["--draft", args.draft]
            if name == "serve-dense":
                command += ["--threshold", str(10**9)]
            for flag in ("prefix_cache_bytes", "draft_prefix_cache_bytes", "disk_cache_gb"):
                if getattr(args, flag) is not None:
                    command += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
            if args.kv_cache_bytes is not None:
                command += ["--kv-cache-gb", str(args.kv_cache_bytes / 1e9)]
        self.command = command
        self.log = self.dir / "server.log"
        with open(self.log, "w") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log,
                                            stderr=subprocess.STDOUT, cwd=self.dir)
        self.url, self.peak, self.stop_sampling = f"http://127.0.0.1:{self.port}", 0, False
        deadline = time.monotonic() + START_SECONDS
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.log.read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{name} did not start in {START_SECONDS} s")
            time.sleep(0.2)
        self.model = "default_model" if name == "mlx-lm" else \
            httpx.get(self.url + "/v1/models", timeout=5).json()["data"][0]["id"]
        self.sampler = threading.Thread(target=self._sample, daemon=True)
        self.sampler.start()

    def _sample(self):
        while not self.stop_sampling and self.process.poll() is None:
            self.peak = max(self.peak, tree_rss(self.process.pid))
            time.sleep(0.25)

    def apis(self) -> dict:
        return {"openai": "openai"} if self.name == "mlx-lm" else {
            a: a for a in ("openai", "anthropic", "responses")}

    def close(self) -> dict:
        """Stop it (SIGTERM, then SIGKILL after 20 s); its log's verdict."""
        self.stop_sampling = True
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        log = self.log.read_text(errors="replace")
        return {"tracebacks": log.count("Traceback"), "log_tail": log[-3000:] if
                "Traceback" in log else "", "exit": self.process.returncode}


# --- runs and their summaries ------------------------------------------------------------

def percentile(values: list, q: float) -> Optional[float]:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[max(0, math.ceil(q * len(values)) - 1)]


def opens_with_text(record: dict) -> bool:
    """The reply's first content was text (records written before `first_kind` was
    kept: it has text at all; these models write their text before their calls)."""
    kind = record.get("first_kind")
    return kind == "text" if kind else bool((record.get("text") or "").strip())


def summarize(records: list) -> dict:
    """Requests, failures, TTFT p50 / p99, decode tokens/s, cache shares of `records`."""
    done = [r for r in records if r["attempt"] in ("full", "retry")]
    ok = [r for r in done if not r["failures"] and r["status"] == 200]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    text_ttft = list(clean_text_ttft(records).values())
    waits = [r["server_timings"]["queue_wait"] for r in ok
             if (r.get("server_timings") or {}).get("queue_wait") is not None]
    decode = [r["decode_tok_s"] for r in ok if r.get("decode_tok_s")]
    first_share, later, later_header, unreported = [], [], [], 0
    of_previous = {False: [], True: []}
    by_session = {}
    for r in done:
        if r["attempt"] == "full":
            by_session.setdefault(r["session"], []).append(r)
    for turns in by_session.values():
        turns.sort(key=lambda r: r["turn"])
        for previous, r in zip([None] + turns[:-1], turns):
            if r.get("cached_tokens") is None:
                unreported += r["status"] == 200
                continue
            if previous is None:
                if r.get("shared_other"):  # what earlier sessions of its kind share with it
                    first_share.append(min(1.0, r["cached_tokens"] / r["shared_other"]))
            else:
                share = min(1.0, r["cached_tokens"] / max(1, r["shared_previous"] or 0))
                (later_header if r["header"] else later).append(share)
                if previous.get("prompt_tokens"):
                    of_previous[r["header"]].append(
                        min(1.0, r["cached_tokens"] / previous["prompt_tokens"]))
    middle = lambda v: statistics.median(v) if v else None  # noqa: E731
    return {
        "requests": len(records), "completed": len(ok),
        "failures": sum(bool(r["failures"]) for r in records),
        "failure_kinds": sorted({f.split(":")[0] for r in records for f in r["failures"]}),
        "clear_4xx": sum(bool(r.get("clear_4xx")) for r in records),
        "tool_calls": sum(len(r.get("tool_calls") or []) for r in records),
        "notes": {n: sum(n in r.get("notes", []) for r in records)
                  for n in sorted({n for r in records for n in r.get("notes", [])})},
        "retry_differs": sum(bool(r.get("retry_differs")) for r in records),
        "ttft_p50": percentile(ttft, 0.5), "ttft_p99": percentile(ttft, 0.99),
        # the replies whose first token the client sees as it comes (they open with text)
        "text_ttft_p50": percentile(text_ttft, 0.5), "text_ttft_p99": percentile(text_ttft, 0.99),
        "decode_tok_s": statistics.median(decode) if decode else None,
        # serve's own count: seconds a request waited for admission (memory, batch size)
        "queue_wait_p99": percentile(waits, 0.99),
        # cached / the tokens it shares with earlier sessions of its kind (first requests)
        "first_turn_cached_share": statistics.mean(first_share) if first_share else None,
        # cached / the tokens a later request shares with its session's previous one
        "later_turn_cached_share_min": min(later) if later else None,
        "later_turn_cached_share_median": middle(later),
        "header_later_turn_cached_share_min": min(later_header) if later_header else None,
        "header_later_turn_cached_share_median": middle(later_header),
        # cached / the previous request's whole prompt (the server's own count)
        "later_turn_cached_of_previous_median": middle(of_previous[False]),
        "header_later_turn_cached_of_previous_median": middle(of_previous[True]),
        "cached_unreported": unreported,
        "from_disk": sum("(disk)" in ((r.get("report") or {}).get("reuse") or "") for r in done),
        "engaged": sum(bool((r.get("report") or {}).get("engaged")) for r in done),
    }


async def replay(sessions: list, server_url: str, apis: dict, model: str, args,
                 solo: bool = False) -> tuple:
    t0 = time.perf_counter()
    if solo:  # one at a time, no tool time: each alone on the server
        records = []
        for s in sessions:
            records += await run_session(s, server_url, apis, model, args, t0, 0, False)
    else:
        runs = await asyncio.gather(*[run_session(s, server_url, apis, model, args, t0,
                                                  i * args.stagger)
                                      for i, s in enumerate(sessions)])
        records = [r for run in runs for r in run]
    return records, time.perf_counter() - t0


def warm(server_url: str, apis: dict, model: str) -> None:
    """One short request through each API first (unmeasured): one-time costs."""
    for api in apis:
        session = {"index": -1, "system": "You are terse.", "tools": [], "api": api}
        request = {"turn": 0, "messages": [{"role": "user", "content": "Say hi."}],
                   "max_tokens": 4, "after_tool": False, "header": None, "billing": BILLING.format(0)}
        async def once():
            async with httpx.AsyncClient() as client:
                await send(client, server_url, session, request, api, model, "full", 120,
                           time.perf_counter())

        asyncio.run(once())


def compare_solo(loaded: list, solo: list) -> dict:
    """Answers of the loaded run that differ from the same request's alone."""
    alone = {(r["session"], r["turn"]): answer(r) for r in solo
             if r["attempt"] == "full" and not r["failures"]}
    checked, differ = 0, []
    for r in loaded:
        key = (r["session"], r["turn"])
        if r["attempt"] == "full" and not r["failures"] and key in alone:
            checked += 1
            if answer(r) != alone[key]:
                differ.append({"session": r["session"], "turn": r["turn"],
                               "loaded": r.get("text", "")[:80], "solo": alone[key][0][:80]})
    return {"checked": checked, "differ": len(differ), "cases": differ}


def run_one(name: str, sessions: list, args, workdir: Path, solo: bool = False) -> dict:
    server = Server(name, args, workdir)
    try:
        warm(server.url, server.apis(), server.model)
        records, wall = asyncio.run(replay(sessions, server.url, server.apis(), server.model,
                                           args, solo))
    finally:
        log = server.close()
    result = {"server": name, "sessions": len(sessions), "wall": wall, "peak_rss": server.peak,
              "tracebacks": log["tracebacks"], "log_tail": log["log_tail"], "records": records,
              "summary": summarize(records), "command": server.command}
    if log["tracebacks"]:
        result["summary"]["failures"] += 1
        result["summary"]["failure_kinds"].append("traceback in the server log")
    return result


def per_session(records: list) -> dict:
    out = {}
    for r in records:
        out.setdefault(r["session"], []).append(r)
    return {s: {"requests": len(rs), **{k: v for k, v in summarize(rs).items()
                                        if k in ("failures", "ttft_p50", "ttft_p99", "decode_tok_s",
                                                 "later_turn_cached_share_min",
                                                 "header_later_turn_cached_share_min")}}
            for s, rs in sorted(out.items())}


def fmt(value, scale=1.0, digits=2) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def table(runs: list) -> str:
    lines = ["| sessions | server | repeat | wall s | TTFT p50 s | TTFT p99 s "
             "| text-first TTFT p50 / p99 s | decode tok/s "
             "| 1st turn cached | later turns: cached / shared min, cached / previous prompt "
             "| with header: cached / shared min, cached / previous prompt "
             "| requests | failures | retry differs | solo differs | peak RSS MB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- |"]
    for run in runs:
        s = run["summary"]
        solo = run.get("solo")
        lines.append(
            f"| {run['sessions']} | {run['server']} | {run.get('repeat', 0)} | {run['wall']:.1f} "
            f"| {fmt(s['ttft_p50'])} | {fmt(s['ttft_p99'])} "
            f"| {fmt(s.get('text_ttft_p50'))} / {fmt(s.get('text_ttft_p99'))} "
            f"| {fmt(s['decode_tok_s'], digits=0)} "
            f"| {fmt(s['first_turn_cached_share'])} | {fmt(s['later_turn_cached_share_min'])}, "
            f"{fmt(s['later_turn_cached_of_previous_median'])} "
            f"| {fmt(s['header_later_turn_cached_share_min'])}, "
            f"{fmt(s['header_later_turn_cached_of_previous_median'])} | {s['requests']} | {s['failures']} "
            f"| {s['retry_differs']} | {'-' if solo is None else '%d/%d' % (solo['differ'], solo['checked'])} "
            f"| {run['peak_rss'] / 2**20:.0f} |")
    return "\n".join(lines)


def clean_text_ttft(records: list) -> dict:
    """(session, turn, attempt) -> TTFT of each request answered well-formed (no
    failure) whose reply opened with text."""
    return {(r["session"], r["turn"], r["attempt"]): r["ttft"] for r in records
            if r["attempt"] in ("full", "retry") and r["status"] == 200 and not r["failures"]
            and r["ttft"] is not None and opens_with_text(r)}


def paired(runs: list) -> str:
    """TTFT over the same requests: per N and repeat, the first run's server against each
    other's, over the requests both answered well-formed with text first (a reply one
    server sends as a call and the other as text, or one it fails, is left out)."""
    lines = ["| sessions | servers | requests both answered with text | TTFT p50 s | "
             "TTFT p99 s |", "| --- | --- | --- | --- | --- |"]
    groups = {}
    for run in runs:
        groups.setdefault((run["sessions"], run.get("repeat", 0)), []).append(run)
    for (n, _), group in groups.items():
        first = clean_text_ttft(group[0]["records"])
        for other in group[1:]:
            theirs = clean_text_ttft(other["records"])
            both = sorted(first.keys() & theirs.keys())
            if not both:
                continue
            a, b = [first[k] for k in both], [theirs[k] for k in both]
            lines.append(
                f"| {n} | {group[0]['server']} / {other['server']} | {len(both)} "
                f"| {fmt(percentile(a, 0.5))} / {fmt(percentile(b, 0.5))} "
                f"| {fmt(percentile(a, 0.99))} / {fmt(percentile(b, 0.99))} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def build_sessions(args, n: int) -> list:
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(args.model))
    shapes = {kind: scaled_shape(kind, tokenizer, args.system_tokens) for kind in args.kinds}
    sessions = [make_session(i, args, tokenizer, shapes) for i in range(n)]
    firsts = {}
    for session in sessions:  # a first request's prefix shared with earlier sessions' first
        ids = prompt_ids(tokenizer, session, session["requests"][0])
        earlier = firsts.setdefault(session["kind"], [])
        session["requests"][0]["shared_other"] = max((common(ids, e) for e in earlier), default=0)
        earlier.append(ids)
    return sessions


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--model", help="target model folder (default: the demo target)")
    parser.add_argument("--draft", help="draft model folder (default: the demo draft, with "
                        "the demo target)")
    parser.add_argument("--target-shape", help="random-weight target of this shape (GPU "
                        "timing: e.g. qwen3-8b); its draft --draft-shape")
    parser.add_argument("--draft-shape", default="qwen3-0.6b")
    parser.add_argument("--sessions", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--mlx-lm-args", default="",
                        help="more flags for mlx_lm.server (e.g. '--prompt-concurrency 1')")
    parser.add_argument("--servers", nargs="+", default=["serve", "mlx-lm"],
                        choices=["serve", "serve-dense", "mlx-lm"],
                        help="servers this run starts, side by side, the first alternating")
    parser.add_argument("--url", help="a server already running instead (not stopped here)")
    parser.add_argument("--api", choices=["all", "openai"], default="all",
                        help="with --url: the APIs it has")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--small", action="store_true", help="CPU smoke lengths: "
                        + ", ".join(f"{k} {v}" for k, v in SMALL.items()))
    parser.add_argument("--system-tokens", type=int, help="system prompt + tools per client "
                        f"kind (default {DEFAULTS['system_tokens']})")
    parser.add_argument("--tool-result-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help=f"each tool result (default {DEFAULTS['tool_result_tokens']})")
    parser.add_argument("--reply-tokens", type=int, nargs=2, metavar=("MIN", "MAX"),
                        help=f"max_tokens of each request (default {DEFAULTS['reply_tokens']})")
    parser.add_argument("--turns", type=int, help=f"requests a session (default {DEFAULTS['turns']})")
    parser.add_argument("--tool-seconds", type=float, help="mean tool time between turns "
                        f"(default {DEFAULTS['tool_seconds']})")
    parser.add_argument("--stagger", type=float, help="seconds between sessions' starts "
                        f"(default {DEFAULTS['stagger']})")
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=list(KINDS))
    parser.add_argument("--context", type=int, help="prompt + reply bound (default: the "
                        "model's max_position_embeddings)")
    parser.add_argument("--prefix-cache-bytes", type=int, help="serve's prefix cache and "
                        "mlx-lm's --prompt-cache-bytes (default: theirs)")
    parser.add_argument("--draft-prefix-cache-bytes", type=int)
    parser.add_argument("--kv-cache-bytes", type=int, help="serve's running KV budget")
    parser.add_argument("--disk-cache-gb", type=float, help="serve's disk tier (default 10)")
    parser.add_argument("--check-solo", nargs="*", metavar="SERVER", help="replay every "
                        "session alone too (on these of --servers; none named: all) and compare "
                        "answers")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", help="servers' folders and logs (default: a temp dir, "
                        "removed at the end)")
    parser.add_argument("--json", help="write every run, record and summary here")
    parser.add_argument("--summarize", nargs="+", metavar="FILE", help="print the table of "
                        "runs saved with --json, summarized as this version does; run nothing")
    args = parser.parse_args(argv)
    preset = SMALL if args.small else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.target_shape:
        from common import random_model_dir

        args.model = random_model_dir(args.target_shape)
        args.draft = args.draft or random_model_dir(args.draft_shape, seed=1)
    if not args.model:
        args.model, args.draft = str(DEMO_TARGET), args.draft or str(DEMO_DRAFT)
    if args.context is None:
        config = json.loads((Path(args.model) / "config.json").read_text())
        args.context = config.get("max_position_embeddings", 32768)
    return args


def commit() -> str:
    """This tree's commit (and "+changes" where it differs from it)."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return head + ("+changes" if dirty else "")
    except OSError:
        return ""


def main(argv=None) -> dict:
    args = parse(argv)
    if args.summarize:
        runs = [dict(run, summary=summarize(run["records"]))
                for path in args.summarize for run in json.loads(Path(path).read_text())["runs"]]
        print(table(runs))
        print(paired(runs))
        return {"runs": runs}
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sessions-"))
    workdir.mkdir(parents=True, exist_ok=True)
    all_sessions = build_sessions(args, max(args.sessions))
    prompt_sizes = [len(json.dumps(s["requests"][-1]["messages"])) for s in all_sessions]
    print(f"{len(all_sessions)} sessions of {[len(s['requests']) for s in all_sessions]} "
          f"requests; last prompts {min(prompt_sizes)}-{max(prompt_sizes)} chars",
          file=sys.stderr, flush=True)
    runs, solo = [], {}

    def save():
        if args.json:
            result = {"args": dict(vars(args)), "commit": commit(), "runs": runs,
                      "table": table(runs), "paired": paired(runs),
                      "solo": {k: {kk: vv for kk, vv in v.items() if kk != "log_tail"}
                               for k, v in solo.items()}}
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1))
            return result
    try:
        if args.url:
            apis = {"openai": "openai"} if args.api == "openai" else {
                a: a for a in ("openai", "anthropic", "responses")}
            model = httpx.get(args.url + "/v1/models").json()["data"][0]["id"]
            for n in args.sessions:
                for repeat in range(args.repeats):
                    records, wall = asyncio.run(replay(all_sessions[:n], args.url, apis, model, args))
                    runs.append({"server": args.url, "sessions": n, "repeat": repeat, "wall": wall,
                                 "peak_rss": 0, "records": records, "summary": summarize(records)})
                    print(table(runs[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
        else:
            if args.check_solo is not None:
                for name in [n for n in args.servers if n in (args.check_solo or args.servers)]:
                    solo[name] = run_one(name, all_sessions, args, workdir, solo=True)
                    print(f"solo {name}: {solo[name]['wall']:.1f} s, "
                          f"{solo[name]['summary']['failures']} failures", file=sys.stderr,
                          flush=True)
            turn = 0
            for n in args.sessions:
                for repeat in range(args.repeats):
                    order = args.servers[turn % len(args.servers):] + \
                        args.servers[:turn % len(args.servers)]
                    turn += 1
                    for position, name in enumerate(order):
                        run = run_one(name, all_sessions[:n], args, workdir)
                        run.update(repeat=repeat, position=position)
                        if name in solo:
                            run["solo"] = compare_solo(run["records"], solo[name]["records"])
                        run["per_session"] = per_session(run["records"])
                        runs.append(run)
                        save()
                        print(table([run]).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    result = {"args": dict(vars(args)), "runs": runs, "solo": solo, "table": table(runs),
              "paired": paired(runs)}
    print(result["table"])
    print(result["paired"])
    save()
    return result


if __name__ == "__main__":
    main()
