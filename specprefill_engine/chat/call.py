"""One engine call from a chat request, the same for every integration (the HTTP
server and `ChatSpecPrefill`): the rendered prompt, the engine's keyword arguments,
and the parser that reads its output.

Tool choice is enforced by constrained decoding (`chat.tool_request`): a forced
choice ("required" or a tool's name) becomes the engine's constrained `tool_call`
format in the model's own call markup (Hermes JSON, Qwen3-Coder XML, GLM 4.7); "auto"
is constrained too in those formats (free text, and any call the model starts is a
valid one), parsed only in others; "none" shows the tools and parses no calls. An
explicit `response_format` wins over the tool format. Building a call renders the
chat template (the prompt's tokens, and whether it opens a think block): async
callers run it in a thread, since tokenizing a long prompt takes milliseconds.
"""

from dataclasses import dataclass
from typing import Optional, Union

from ..engine.options import RequestOptions
from .render import Rendered, tool_request
from .parser_events import TextEvent
from .tool_calls import OutputParser


@dataclass
class Call:
    """One engine request: the prompt, the engine's keyword arguments, how to read it.
    A prompt that is no rendered chat (plain completions) is read as written."""

    prompt: Union[str, list, Rendered]
    options: dict
    tools: Optional[list] = None
    parse_tools: bool = False

    @property
    def stops(self) -> tuple:
        return tuple(self.options.get("stop") or ())

    def parser(self, tokenizer) -> Optional[OutputParser]:
        if not isinstance(self.prompt, Rendered):
            return None
        return OutputParser(tokenizer, parse_tools=self.parse_tools, tools=self.tools,
                            in_reasoning=self.prompt.think_open)

    def read(self, parser: Optional[OutputParser], text: str,
             finish_reason: Optional[str]) -> list:
        """Events of a piece of output (a `finish_reason`: the end, flush what was held)."""
        if parser is None:
            return [TextEvent(text)] if text else []
        events = parser.feed(text)
        if finish_reason is not None:
            events += parser.finish(finish_reason)
        return events

    def reply(self, tokenizer, result) -> list:
        """Events of a whole reply (a Result)."""
        return self.read(self.parser(tokenizer), result.text, result.finish_reason)


def build_call(engine, messages: list, options: dict, *, tools: Optional[list] = None,
               tool_choice=None, parallel: bool = True, response_format: Optional[dict] = None,
               reasoning_budget: Optional[int] = None,
               template_kwargs: Optional[dict] = None) -> Call:
    """An engine call for chat messages (OpenAI-style dicts), with tools in OpenAI's
    function form and `tool_choice` as `check_tool_choice` takes it (without tools it is
    not read). `reasoning_budget` goes with a constrained format (`chat/constrained.py`)."""
    options = dict(options)
    parse_tools = False
    if tools:
        choice, response_format = tool_request(engine.tokenizer, tools, tool_choice, parallel,
                                               response_format)  # its errors name the field
        parse_tools = choice != "none"
    if response_format is not None:
        if reasoning_budget is not None:
            response_format = {**response_format, "reasoning_budget": reasoning_budget}
        options["response_format"] = response_format
    RequestOptions.of("the request", options)  # a bad option fails before the prompt renders
    rendered = engine.render(messages, tools, template_kwargs)
    return Call(rendered, options, tools, parse_tools)
