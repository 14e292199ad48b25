"""What `tool_calls.OutputParser` reads in a reply's text, in the order the model wrote
it: content text, reasoning text and tool calls, each its own type, so a reader
dispatches on the type rather than on a name."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class TextEvent:
    """Content: what the model says to the user."""

    text: str


@dataclass
class ReasoningEvent:
    """Text inside a think block."""

    text: str


@dataclass
class ToolCallEvent:
    """A complete (or, at the end of the output, unterminated) tool call."""

    index: int
    id: str
    name: Optional[str]
    args: str  # JSON text of the arguments; not JSON when the call was malformed
    error: Optional[str] = None
    cut: bool = False  # the output ended inside the call (max_tokens, a stop string, ...)
