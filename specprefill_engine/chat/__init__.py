"""Chat requests around the engine: a chat rendered through its template with the tokens
SpecPrefill must keep (`render`, `segments`), one engine call built from a chat request
(`call`), a reply's text read back as content, reasoning and tool calls (`tool_calls`,
`parser_events`), and constrained decoding of response formats and tool calls
(`constrained`, which needs the `constrained` extra: import it where it is used)."""

from .call import Call, build_call
from .parser_events import ReasoningEvent, TextEvent, ToolCallEvent
from .render import Rendered, render_chat
from .tool_calls import OutputParser, ToolsNotSupportedError

__all__ = ["Call", "OutputParser", "ReasoningEvent", "Rendered", "TextEvent", "ToolCallEvent",
           "ToolsNotSupportedError", "build_call", "render_chat"]
