"""Reading cases in English prose, for real pretrained models (`gguf.py`).

Filler is the prose of Python's own reference documentation (`pydoc_data.topics`, in
every CPython), paragraphs in order from a seeded start; needle sentences are spliced in
between paragraphs at seeded depths. Kinds: a passkey; a multi-key lookup among
distractor keys; a two-hop lookup (one key points to another); a short extractive
question over a made-up paragraph; a few-sentence summary (scored against the dense
answer, there is no fixed one). Prompts are built from separately tokenized pieces, so
the needles' token spans are known exactly (for the selection's needle coverage).
An instruct model gets its chat template; a base model a plain "Question: / Answer:"
layout. Either way the answer's opening words are already in the prompt, so the first
generated tokens are the answer. The same seed gives the same case on the same Python.
"""

import random
import re
from dataclasses import dataclass
from functools import lru_cache

KINDS = ("passkey", "multikey", "two_hop", "qa", "summary")
THINGS = (
    "amber lantern", "blue heron", "copper kettle", "silver anchor", "green fern", "stone bridge",
    "paper crane", "iron gate", "wool blanket", "glass harbor", "cedar chest", "velvet glove",
    "marble stair", "tin whistle", "brass compass", "linen sail",
)
FIRST = ("Ada", "Bruno", "Clara", "Dmitri", "Elena", "Felix", "Greta", "Hugo", "Iris", "Jonas",
         "Katya", "Lorenzo", "Mira", "Nils", "Olga", "Pavel")
LAST = ("Quill", "Ramsay", "Sorensen", "Thorne", "Ubaldi", "Vance", "Whitlock", "Yarrow",
        "Zeller", "Marsh", "Holloway", "Kestrel")
TOWNS = ("Marrowby", "Ellsworth", "Brackenridge", "Stonehaven", "Ashcombe", "Wetherfield",
         "Dunmore", "Fallowmere")
RIVERS = ("Tell", "Orrin", "Vesk", "Maun", "Caddon", "Lisle")
TRADES = ("a ferry", "a bakery", "a printing press", "a glassworks", "a school", "a mill")


@dataclass(frozen=True)
class ProseCase:
    kind: str
    ids: list  # the whole prompt, token ids
    answer: str  # "" for a summary: scored against the dense answer
    needles: tuple  # (start, end) token spans of the sentences the answer needs
    max_tokens: int
    head: int  # tokens before the document (the chat template's opening): to protect


@lru_cache(maxsize=1)
def paragraphs() -> tuple:
    """The reference documentation's prose paragraphs, each on one line (code blocks,
    grammar rules, headings and paragraphs with digits left out: the codes asked for
    are the only numbers)."""
    from pydoc_data.topics import topics

    found = []
    for key in sorted(topics):
        for block in topics[key].split("\n\n"):
            if not block.strip() or block[0].isspace() or set(block.splitlines()[-1]) <= set("*=-"):
                continue
            line = " ".join(block.split())
            if len(line) > 80 and "::=" not in line and not re.search(r"\d", line):
                found.append(line)
    return tuple(found)


def _code(rng: random.Random) -> str:
    return str(rng.randrange(10_000, 100_000))


def _needles(rng: random.Random, kind: str) -> tuple:
    """(needle sentences, of which the answer needs, question, answer prefix, answer)."""
    if kind == "passkey":
        code = _code(rng)
        return ([f"The secret passkey is {code}. Remember it."], [0], "What is the secret passkey?",
                "The secret passkey is", code)
    if kind == "multikey":
        things = rng.sample(THINGS, 4)
        codes = [_code(rng) for _ in things]
        asked = rng.randrange(len(things))
        sentences = [f"The special code for the {t} is {c}." for t, c in zip(things, codes)]
        return (sentences, [asked], f"What is the special code for the {things[asked]}?",
                f"The special code for the {things[asked]} is", codes[asked])
    if kind == "two_hop":
        source, target, *others = rng.sample(THINGS, 4)
        code = _code(rng)
        sentences = [f"The {source} has the same code as the {target}.",
                     f"The special code for the {target} is {code}."]
        sentences += [f"The special code for the {t} is {_code(rng)}." for t in others]
        return (sentences, [0, 1], f"What is the special code for the {source}?",
                f"The special code for the {source} is", code)
    if kind == "qa":
        town, river, trade = rng.choice(TOWNS), rng.choice(RIVERS), rng.choice(TRADES)
        founder = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        builder = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        year = rng.randrange(1700, 1900)
        story = (f"The town of {town} lies on the river {river}. It was founded in {year} by "
                 f"{founder}, who opened {trade} there. Its bridge was built later by {builder}.")
        asked = rng.choice(["founder", "builder", "river"])
        question, prefix, answer = {
            "founder": (f"Who founded the town of {town}?", f"The town of {town} was founded by",
                        founder),
            "builder": (f"Who built the bridge of {town}?", f"The bridge of {town} was built by",
                        builder),
            "river": (f"On which river does {town} lie?", f"{town} lies on the river", river),
        }[asked]
        return [story], [0], question, prefix, answer
    if kind == "summary":
        return [], [], "Summarize the text above in two sentences.", "Summary:", ""
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def layout(tokenizer, question: str, prefix: str) -> tuple:
    """(text before the document, text after it): the chat template's user turn with the
    answer's opening in the reply, or a plain layout for a base model."""
    if getattr(tokenizer, "chat_template", None):
        marker = "\x00"
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": marker}],
                                                 tokenize=False, add_generation_prompt=True)
        head, tail = rendered.split(marker)
        return head, f"\n\n{question}{tail}{prefix}"
    return "", f"\n\nQuestion: {question}\nAnswer: {prefix}"


AGENT_SYSTEM = "You are a coding assistant. Read files with the tools before you answer."
READ_FILE = {"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                   "required": ["path"]}}}


def parts(tokenizer, ids: list, head: int) -> tuple:
    """A case's prompt (`layout`'s, `head` tokens before the document) as (the user's
    message: the document, then the question; the reply's opening)."""
    template_tail = layout(tokenizer, "", "")[1].removeprefix("\n\n")
    text = tokenizer.decode(ids[head:])
    at = text.rindex(template_tail)
    return text[:at], text[at + len(template_tail):]


def agent_messages(message: str, path: str) -> list:
    """A case's user message (`parts`) as a coding agent's chat (tools: `[READ_FILE]`):
    the question, the call that reads `path`, and the document as its result; the
    question is not among its last tokens."""
    document, question = message.rsplit("\n\n", 1)
    document = document.removeprefix("```python\n").removesuffix("```")
    return [
        {"role": "system", "content": AGENT_SYSTEM},
        {"role": "user", "content": f"{question} It is in {path}."},
        {"role": "assistant", "content": "", "tool_calls": [{
            "id": "call_0", "type": "function",
            "function": {"name": "read_file", "arguments": {"path": path}}}]},
        {"role": "tool", "tool_call_id": "call_0", "name": "read_file", "content": document},
    ]


def make_case(tokenizer, kind: str, length: int, seed: int) -> ProseCase:
    """A prompt of about `length` tokens (whole paragraphs) of `kind`."""
    rng = random.Random(f"{kind}:{length}:{seed}")
    sentences, needed, question, prefix, answer = _needles(rng, kind)
    head, tail = layout(tokenizer, question, prefix)

    def encode(text: str, first: bool = False) -> list:
        return tokenizer.encode(text, add_special_tokens=first)

    head_ids, tail_ids = encode(head, first=True), encode(tail)
    needle_ids = [encode(s + "\n\n") for s in sentences]
    budget = length - len(head_ids) - len(tail_ids) - sum(map(len, needle_ids))
    texts = paragraphs()
    start = rng.randrange(len(texts))
    filler, used = [], 0
    while used < budget:
        ids = encode(texts[(start + len(filler)) % len(texts)] + "\n\n")
        filler.append(ids)
        used += len(ids)
    slots = sorted(rng.sample(range(1, len(filler)), min(len(needle_ids), len(filler) - 1)))
    order = list(range(len(needle_ids)))
    rng.shuffle(order)  # needles in a random order (a two-hop pointer may follow its target)
    pieces, spans, spliced = [head_ids], {}, 0
    for index, paragraph in enumerate(filler):
        while spliced < len(slots) and slots[spliced] == index:
            at = sum(map(len, pieces))
            needle = order[spliced]
            pieces.append(needle_ids[needle])
            spans[needle] = (at, at + len(needle_ids[needle]))
            spliced += 1
        pieces.append(paragraph)
    pieces.append(tail_ids)
    ids = [token for piece in pieces for token in piece]
    max_tokens = 48 if kind == "summary" else len(encode(" " + answer)) + 2
    return ProseCase(kind, ids, answer, tuple(spans[i] for i in needed), max_tokens, len(head_ids))


def words(text: str) -> list:
    return re.findall(r"[a-z0-9]+", text.lower())


def is_right(case: ProseCase, text: str) -> bool:
    """Whether a reply opens with the answer (case and punctuation aside)."""
    expected = words(case.answer)
    return words(text)[: len(expected)] == expected

