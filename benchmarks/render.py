"""What preparing a chat prompt costs: the chat template rendered once vs the calls of
d6e03d5, side by side in one process, on the demo tokenizer.

The chat is an agent's: a system prompt with tools, a user turn with documents, then
rounds of an assistant tool call, its result and a question, until about `--tokens`
tokens. d6e03d5 rendered per LangChain request: the prompt as text (think
detection), the prompt tokenized, two tokenized prefixes (system end, newest
message) and the first message tokenized with and without tools (tool span).
`render_chat` renders the text once, tokenizes it once and renders as text the
prefixes whose starts it gives (by default the system end, the newest user or tool
message, the generation prompt and the last 4 messages; `window=None`: every
message's). Timings are medians over `--repeats` of the same chat, so the
tokenizer's word cache is warm for every side, as it is across an agent's turns.

    .venv/bin/python benchmarks/render.py --tokens 32768 --repeats 5
"""

import argparse
import json
import statistics
import time

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
from mlx_lm.tokenizer_utils import load

from specprefill_engine.demo_tasks import AGENT_TOOLS, make_agent_session
from specprefill_engine.engine.chat import render_chat
from specprefill_engine.loading import DEMO_TARGET


def agent_chat(tokenizer, n_tokens: int) -> list:
    session = make_agent_session(tokenizer, 0, min(n_tokens // 4, 8000), 8)
    messages = [{"role": "system", "content": session.system},
                {"role": "user", "content": f"{session.documents}\n{session.questions[0]}"}]
    step = 0
    while len(tokenizer.apply_chat_template(messages, tools=list(AGENT_TOOLS))) < n_tokens:
        step += 1
        messages.append({"role": "assistant", "content": "", "tool_calls": [{
            "id": f"call_{step}", "type": "function",
            "function": {"name": "read_file", "arguments": {"path": f"src/module_{step}.py"}}}]})
        messages.append({"role": "tool", "content": session.tool_results[step % 8],
                         "tool_call_id": f"call_{step}"})
        messages.append({"role": "user", "content": session.questions[step % 8]})
    return messages


def old_sequence(tokenizer, messages: list, tools: list) -> None:
    """The template calls d6e03d5 made for one LangChain request (messages then held
    string arguments; the demo template takes either)."""
    tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                  tokenize=False)  # think detection
    tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    last = max(i for i, m in enumerate(messages) if m["role"] in ("user", "tool"))
    for index in (1, last):  # message starts
        tokenizer.apply_chat_template(messages[:index], tools=tools)
    tokenizer.apply_chat_template(messages[:1], tools=tools)  # tool span
    tokenizer.apply_chat_template(messages[:1])


def timings_ms(calls: dict, repeats: int) -> dict:
    """Median and min ms of each call, the calls interleaved so they share the load."""
    times: dict = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return {name: {"median_ms": round(1000 * statistics.median(t), 1),
                   "min_ms": round(1000 * min(t), 1)} for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    tokenizer = load(DEMO_TARGET)
    tools = list(AGENT_TOOLS)
    messages = agent_chat(tokenizer, args.tokens)
    rendered = render_chat(tokenizer, messages, tools)  # warm: template compiled, probes run
    report = {
        "tokens": int(rendered.tokens.size),
        "messages": len(messages),
        "message_starts_given": sum(s is not None for s in rendered.message_starts),
        **timings_ms({
            "d6e03d5": lambda: old_sequence(tokenizer, messages, tools),
            "render_chat": lambda: render_chat(tokenizer, messages, tools),
            "render_chat_every_start": lambda: render_chat(tokenizer, messages, tools,
                                                           window=None),
            "one_text_render": lambda: tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False),
            "one_tokenization": lambda: tokenizer.encode(rendered.text, add_special_tokens=False),
        }, args.repeats),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
