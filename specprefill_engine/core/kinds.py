"""What kind of content a prompt's sparsified part is: code or prose.

The selection keeps chunks of a fixed grid; in code a chunk's end can cut a function or a
statement and glue it to another's, and a target reading such a view can answer otherwise
than dense even where the answer's own tokens are kept. So the draft check judges each
kind apart and the automatic policy engages per kind (`engine/vouch.py`). The test is a
plain one over lines: the share of non-empty lines that look like source code.
"""

import re

KINDS = ("code", "prose")
CODE_SHARE = 0.3  # of the non-empty lines, looking like code: the content is code
CODE_LINES = 40  # lines looking like code: code among more prose (a file an agent read)
_CODE_LINE = re.compile(
    r"^\s*(def |class |import |from \S+ import |return\b|if .*:$|for .*:$|while .*:$|"
    r"elif |else:|try:|except|with .*:$|@\w|#include|fn |func |function\b|const |let |"
    r"var |public |private |static |package )"
    r"|[;{}]\s*$|^\s*[})\]];?\s*$|^\s*(//|/\*|\*|#)|^\s*\w+(\.\w+)*\s*[+\-*/]?=\s*\S"
    r"|^( {4}|\t)\S")


def content_kind(text: str) -> str:
    """"code" where at least `CODE_SHARE` of the non-empty lines, or `CODE_LINES` of them,
    look like source code, else "prose": a file among long prose instructions is code."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return "prose"
    code = sum(bool(_CODE_LINE.search(line)) for line in lines)
    return "code" if code >= min(CODE_SHARE * len(lines), CODE_LINES) else "prose"
