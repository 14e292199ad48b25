"""Retrieval cases in the demo pair's trained formats (see assets/MODEL_CARD.md).

Filler is Python source read from this interpreter's standard library at run time;
needle lines are spliced in at chosen depths and the question closes the user turn.
The same seed gives the same case on the same Python version. `make_case` feeds the
CLI's `demo` and `eval`; `make_agent_session`, an agent's growing prompt in the same
formats, is the loop that `benchmarks/agent.py` times and the tests replay, kept here so
both run the very same turns.
"""

import os
import random
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("passkey", "assignment", "registry", "two_hop")
WORDS = (
    "alpha bravo cedar delta ember falcon garnet harbor indigo juniper kestrel lumen "
    "meadow nectar onyx pepper quartz raven sierra timber umber velvet willow xenon "
    "yonder zephyr amber basalt cobalt dune"
).split()


@dataclass(frozen=True)
class DemoCase:
    kind: str
    context: str
    question: str
    answer: str
    depths: tuple

    @property
    def messages(self) -> list:
        return [{"role": "user", "content": f"{self.context}\n{self.question}"}]


@lru_cache(maxsize=1)
def filler_lines() -> tuple:
    root = os.path.dirname(os.__file__)
    lines = []
    for name in sorted(os.listdir(root)):
        if name.endswith(".py"):
            with open(os.path.join(root, name), encoding="utf-8", errors="replace") as f:
                lines.extend(line for line in f.read().splitlines(keepends=True) if line.strip())
    return tuple(lines)


def _name(rng: random.Random) -> str:
    return "_".join(rng.sample(WORDS, 2)).upper()


def _digits(rng: random.Random, n: int) -> str:
    return "".join(str(rng.randrange(10)) for _ in range(n))


def _needles(rng: random.Random, kind: str) -> tuple:
    """(needle lines, question, answer) for one task kind."""
    if kind == "passkey":
        code = _digits(rng, rng.choice([4, 5, 6]))
        return [f"# The secret passkey is {code}. Remember it.\n"], "What is the secret passkey?", code
    if kind == "assignment":
        names = list(dict.fromkeys(_name(rng) for _ in range(rng.choice([2, 4, 6]))))
        values = [_digits(rng, 5) for _ in names]
        pick = rng.randrange(len(names))
        lines = [f"{n} = {v}\n" for n, v in zip(names, values)]
        return lines, f"What is the value of {names[pick]}?", values[pick]
    if kind == "registry":
        keys = list(dict.fromkeys(f"{_digits(rng, 3)}-{rng.choice(WORDS)}" for _ in range(rng.choice([2, 4, 8]))))
        values = [_digits(rng, 6) for _ in keys]
        pick = rng.randrange(len(keys))
        lines = [f'REGISTRY["{k}"] = "{v}"\n' for k, v in zip(keys, values)]
        return lines, f'What is REGISTRY["{keys[pick]}"]?', values[pick]
    if kind == "two_hop":
        first, second = _name(rng), _name(rng)
        while second == first:
            second = _name(rng)
        value = _digits(rng, 5)
        return [f"{first} = {value}\n", f"{second} = {first}\n"], f"What is the value of {second}?", value
    raise ValueError(f"unknown task kind {kind!r}; expected one of {KINDS}")


def make_case(tokenizer, seed: int, kind: str = "passkey", n_tokens: int = 2048) -> DemoCase:
    """A case whose chat prompt is about `n_tokens` tokens with `tokenizer`."""
    rng = random.Random(f"{kind}-{n_tokens}-{seed}")
    needles, question, answer = _needles(rng, kind)
    lines = filler_lines()
    start = rng.randrange(len(lines) // 2)
    window = "".join(lines[start : start + n_tokens // 5 + 8])[: n_tokens * 4]
    overhead = len(tokenizer.encode("".join(needles) + question)) + 16
    filler_ids = tokenizer.encode(window)[: max(n_tokens - overhead, 0)]
    body = tokenizer.decode(filler_ids).splitlines(keepends=True)[:-1]
    depths = sorted(rng.random() for _ in needles)
    for depth, needle in sorted(zip(depths, needles), reverse=True):
        body.insert(int(depth * len(body)), needle)
    return DemoCase(kind, "".join(body), question, answer, tuple(round(d, 3) for d in depths))


@dataclass(frozen=True)
class AgentSession:
    """An agent's growing prompt: a system prompt with tools, retrieved documents with
    facts spread through them, then steps that each append a tool result and ask about
    a different fact."""

    system: str
    documents: str
    tool_results: tuple
    questions: tuple
    answers: tuple
    tools: tuple

    def messages(self, step: int, replies: list) -> list:
        """The prompt of step `step` (0-based), given the replies to earlier steps."""
        messages = [{"role": "system", "content": self.system},
                    {"role": "user", "content": f"{self.documents}\n{self.questions[0]}"}]
        for index in range(1, step + 1):
            messages.append({"role": "assistant", "content": replies[index - 1]})
            messages.append({"role": "user", "content":
                             f"{self.tool_results[index]}\n{self.questions[index]}"})
        return messages


AGENT_TOOLS = (
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a symbol.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
)


def make_agent_session(tokenizer, seed: int, n_tokens: int = 6000, steps: int = 6) -> AgentSession:
    """Registry facts at spread depths of ~n_tokens of documents; each step asks for
    another one after a 200-500-token tool result."""
    rng = random.Random(f"agent-{n_tokens}-{seed}")
    keys = list(dict.fromkeys(f"{_digits(rng, 3)}-{rng.choice(WORDS)}" for _ in range(steps * 2)))
    keys = keys[:steps]
    values = [_digits(rng, 6) for _ in keys]
    lines = filler_lines()
    start = rng.randrange(len(lines) // 2)
    window = "".join(lines[start : start + n_tokens // 5 + 8])[: n_tokens * 4]
    filler_ids = tokenizer.encode(window)[:n_tokens]
    body = tokenizer.decode(filler_ids).splitlines(keepends=True)[:-1]
    for index, (key, value) in reversed(list(enumerate(zip(keys, values)))):
        depth = (index + 0.5) / len(keys)
        body.insert(int(depth * len(body)), f'REGISTRY["{key}"] = "{value}"\n')
    results = []
    for _ in range(steps):
        at = rng.randrange(len(lines) - 200)
        size = rng.randint(200, 500)
        results.append(tokenizer.decode(tokenizer.encode("".join(lines[at : at + 120]))[:size]))
    order = list(range(steps))
    rng.shuffle(order)
    return AgentSession(
        system="You are a coding agent. Answer with the value only.",
        documents="".join(body),
        tool_results=tuple(results),
        questions=tuple(f'What is REGISTRY["{keys[i]}"]?' for i in order),
        answers=tuple(values[i] for i in order),
        tools=AGENT_TOOLS,
    )
