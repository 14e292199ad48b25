"""Turn a model's text into LangChain tool calls with the tokenizer's own parser.

mlx-lm's tokenizer wrapper knows the model family's tool-call markers
(`tool_call_start` / `tool_call_end`) and a `tool_parser` for what lies between
them; we only cut the text at the markers and give each call an id.
"""

import json
import uuid
from typing import Optional


def split_tool_calls(text: str, tokenizer, tools: Optional[list] = None) -> tuple[str, list, list]:
    """Return (content without the calls, tool_calls, invalid_tool_calls)."""
    start = getattr(tokenizer, "tool_call_start", None)
    parser = getattr(tokenizer, "tool_parser", None)
    if not start or parser is None or start not in text:
        return text, [], []
    end = getattr(tokenizer, "tool_call_end", None) or ""
    content, calls, invalid = [], [], []
    rest = text
    while start in rest:
        before, _, after = rest.partition(start)
        content.append(before)
        if end and end in after:
            body, _, rest = after.partition(end)
        else:
            body, rest = after, ""
        call_id = f"call_{uuid.uuid4().hex[:24]}"
        try:
            parsed = parser(body, tools)
            for item in parsed if isinstance(parsed, list) else [parsed]:
                arguments = item.get("arguments", {})
                if isinstance(arguments, str):
                    arguments = json.loads(arguments)
                calls.append({"name": item["name"], "args": arguments, "id": call_id,
                              "type": "tool_call"})
                call_id = f"call_{uuid.uuid4().hex[:24]}"
        except Exception as error:
            invalid.append({"name": None, "args": body, "id": call_id, "error": str(error),
                            "type": "invalid_tool_call"})
    content.append(rest)
    return "".join(content).strip(), calls, invalid
