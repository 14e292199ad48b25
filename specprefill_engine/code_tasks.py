"""Code-reading cases over generated Python sources, for real pretrained models.

RepoQA-style needles: a source file of many similar functions, of about the requested
token length, and a question about one of them. Kinds:
- `code_return`: which constant a named function adds before returning (every
  function ends in `return <value> + <constant>`);
- `code_const`: the value of a named module constant, among others (the same file as
  `code_return`'s: a table of constants no function uses above its functions);
- `code_calls`: which function of the file a named function calls (every function
  calls one other);
- `code_far`: the value a named function near the end adds, through a module constant
  defined near the top (every function adds one of the constants).
The source is built from separately tokenized pieces, so the token spans of what the
answer needs (`needles`: the asked function or constant, both for `code_far`) and of the
answer itself (`answer_spans`; for `code_far` also the constant's name where the
function uses it) are exact. Cases of one file differing only in the question (`ask`, or
`code_return` against `code_const`) share it: their prompts are equal up to the
question. The chat template and the answer's opening are laid out as in `prose_tasks`.
The same seed gives the same case.
"""

import random
from dataclasses import dataclass

from .prose_tasks import is_right, layout

__all__ = ["KINDS", "CodeCase", "is_right", "make_case"]

KINDS = ("code_return", "code_calls", "code_far", "code_const")
VERBS = ("scale", "merge", "count", "parse", "load", "build", "clean", "score", "shift",
         "pack", "split", "fold", "trim", "rank", "read", "emit", "join", "check", "index",
         "group")
NOUNS = ("alpha", "bravo", "cedar", "delta", "ember", "falcon", "garnet", "harbor",
         "indigo", "juniper", "kestrel", "lumen", "meadow", "nectar", "onyx", "pepper",
         "quartz", "raven", "sierra", "timber", "umber", "velvet", "willow", "xenon",
         "yonder", "zephyr", "amber", "basalt", "cobalt", "dune")
SUFFIXES = ("LIMIT", "OFFSET", "SCALE", "BASE", "WIDTH", "MARGIN")

# bodies ending in `return <variable> +`, the constant after it; {k}: a small distractor
RETURNS = (
    "def {name}(values, start=0):\n    total = start\n    for value in values:\n"
    "        total += value * {k}\n    return total +",
    "def {name}(items):\n    if not items:\n        return {k}\n    count = len(items)\n"
    "    return count +",
    "def {name}(text, width={k}):\n    words = text.split()\n"
    "    size = sum(len(word) for word in words)\n    return size +",
    "def {name}(table, key):\n    value = table.get(key, {k})\n    value = value * 2\n"
    "    return value +",
    "def {name}(numbers):\n    largest = max(numbers, default={k})\n    return largest +",
)
# bodies calling another function of the file, its name between the two parts
CALLS = (
    ("def {name}(values):\n    result =", "(values)\n    return result"),
    ("def {name}(path, limit={k}):\n    data =", "(path)\n    return data[:limit]"),
    ("def {name}(items):\n    if not items:\n        return None\n    return",
     "(items[0])"),
    ("def {name}(record):\n    record = dict(record)\n    record[\"total\"] =",
     "(record)\n    return record"),
    ("def {name}(text, sep=\",\"):\n    parts = text.split(sep)\n    return",
     "(parts, {k})"),
)


@dataclass(frozen=True)
class CodeCase:
    kind: str
    ids: list  # the whole prompt, token ids
    answer: str
    needles: tuple  # (start, end) token spans of what the answer needs
    answer_spans: tuple  # (start, end) token spans of the answer's own tokens in the source
    max_tokens: int
    head: int  # tokens before the source (the chat template's opening): to protect


def _names(rng: random.Random) -> list:
    """Distinct function names, of two words while they last, then of three."""
    two = [f"{verb}_{noun}" for verb in VERBS for noun in NOUNS]
    three = [f"{verb}_{noun}_{other}" for verb in VERBS for noun in NOUNS for other in NOUNS
             if other != noun]
    return rng.sample(two, len(two)) + rng.sample(three, len(three))


def _function(rng: random.Random, kind: str, name: str) -> tuple:
    """(text before the answer, text after it) of one function."""
    k = rng.randrange(2, 10)
    if kind == "code_calls":
        before, after = rng.choice(CALLS)
        return before.format(name=name, k=k), after.format(k=k) + "\n\n\n"
    return rng.choice(RETURNS).format(name=name, k=k), "\n\n\n"


def _question(kind: str, name: str) -> tuple:
    """(question, the answer's opening)."""
    if kind == "code_calls":
        return (f"Which function defined in this file does `{name}` call?",
                f"The function `{name}` calls `")
    if kind == "code_const":
        return f"What is the value of {name}?", f"{name} ="
    if kind in ("code_return", "code_far"):
        return (f"Which number does the function `{name}` add to its result before "
                f"returning it?", f"The function `{name}` adds")
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")


def _source(rng: random.Random, family: str, budget: int, encode) -> tuple:
    """A file's parts, each as the token ids of (before the answer, the answer, after it):
    (functions, the table's lines in file order, the table's index of each line)."""
    names = _names(rng)
    values = [str(v) for v in rng.sample(range(1000, 10000), 5000)]
    constants = [f"{noun.upper()}_{other.upper()}_{suffix}" for noun, other, suffix in
                 rng.sample([(n, o, s) for n in NOUNS for o in NOUNS for s in SUFFIXES
                             if o != n], len(values))]
    bodies, used = [], 0  # functions until the budget, each answer's length a stand-in's
    while used < budget and len(bodies) < len(values) // 2:
        index = len(bodies)
        bodies.append(_function(rng, "code_calls" if family == "calls" else "code_return",
                                names[index]))
        stand_in = {"calls": names, "named": constants}.get(family, values)[index]
        used += sum(len(encode(text)) for text in (bodies[-1][0], " " + stand_in, bodies[-1][1]))
        if family == "named" or (family == "literal" and index % 3 == 0):
            used += len(encode(f"{constants[index]} = {values[-1 - index]}\n"))
    count = len(bodies)
    if count < 3:
        raise ValueError(f"{budget} tokens hold fewer than three functions")
    if family == "calls":  # another function of the file
        answers = [names[(i + 1 + rng.randrange(count - 1)) % count] for i in range(count)]
    else:
        answers = constants if family == "named" else values
    functions = [(encode(before), encode(" " + answer), encode(after), names[i], values[i])
                 for i, ((before, after), answer) in enumerate(zip(bodies, answers))]
    table = []
    if family == "named":  # the last fifth's constants among the table's first lines
        table = list(range(count))
        rng.shuffle(table)
        early = set(range(count - max(count // 5, 1), count)) | \
            {i for i in table if rng.random() < 0.1}
        table.sort(key=lambda i: i not in early)
        table = [(i, constants[i], values[i]) for i in table]
    elif family == "literal":  # constants no function uses, their values unlike any
        table = [(i, constants[i], values[-1 - i]) for i in range(0, count, 3)]
        rng.shuffle(table)
    lines = [(encode(f"{name} ="), encode(f" {value}"), encode("\n"), name, value, i)
             for i, name, value in table]
    return functions, lines


FAMILIES = {"code_return": "literal", "code_const": "literal", "code_calls": "calls",
            "code_far": "named"}


def make_case(tokenizer, kind: str, length: int, seed: int, ask: int = 0) -> CodeCase:
    """A prompt of about `length` tokens (whole functions) of `kind`; `ask` picks which
    of the eligible functions or constants (in a seeded order) the question names: any
    function for `code_return` and `code_calls`, any module constant for `code_const`,
    a function in the last fifth for `code_far`. `code_return` and `code_const` read the
    same file (similar functions, each adding a literal, under a table of constants no
    function uses): their cases of one seed and length share it."""
    _question(kind, "f")  # the kind is checked before any work
    family = FAMILIES[kind]

    def encode(text: str, first: bool = False) -> list:
        return tokenizer.encode(text, add_special_tokens=first)

    # the file's length must not depend on the question: a typical one is budgeted
    head, tail = layout(tokenizer, *_question("code_return", "merge_cedar"))
    opening = encode('```python\n"""Helpers of the records module."""\n\n\n')
    closing = encode("```")
    budget = length - len(encode(head, first=True)) - len(encode(tail)) - len(opening) - \
        len(closing)
    functions, lines = _source(random.Random(f"{family}:{length}:{seed}"), family, budget,
                               encode)
    count = len(functions)
    if kind == "code_const":
        eligible = list(range(len(lines)))
    elif kind == "code_far":
        eligible = [i for i in range(count) if i >= count - max(count // 5, 1)]
    else:
        eligible = list(range(count))
    random.Random(f"{kind}:{length}:{seed}").shuffle(eligible)
    asked = eligible[ask % len(eligible)]
    if kind == "code_const":
        name, answer = lines[asked][3], lines[asked][4]
    else:
        name = functions[asked][3]
        answer = tokenizer.decode(functions[asked][1]).strip() if kind == "code_calls" \
            else functions[asked][4]

    head, tail = layout(tokenizer, *_question(kind, name))
    pieces, needles, spans = [encode(head, first=True), opening], [], []

    def place(parts: tuple, needed: bool) -> None:
        at = sum(map(len, pieces))
        pieces.extend(parts[:3])
        if needed:  # the middle part: the answer (or, in code_far's function, its name)
            needles.append((at, at + sum(map(len, parts[:3]))))
            spans.append((at + len(parts[0]), at + len(parts[0]) + len(parts[1])))

    far = functions[asked][3] if kind == "code_far" else None
    for line in lines:
        place(line, line[3] == name if kind == "code_const" else
              (far is not None and line[5] == asked))
    if lines:
        pieces.append(encode("\n\n"))  # blank lines after the table
    for i, function in enumerate(functions):
        place(function, i == asked and kind != "code_const")
    pieces += [closing, encode(tail)]
    ids = [token for piece in pieces for token in piece]
    return CodeCase(kind, ids, answer, tuple(needles), tuple(spans), len(encode(" " + answer)) + 2,
                len(pieces[0]))
