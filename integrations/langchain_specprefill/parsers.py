"""Structured-output parsers that say when max_tokens cut the output.

Constrained decoding makes every complete output parse; an output cut by
max_tokens (finish_reason "length") does not, and LangChain's parsers would report a
JSON error, complete a cut JSON object silently (their JSON parsing is lenient), or
for tool calls return None as if the model had called nothing. These subclasses
raise an OutputParserException naming the cut instead, also at the end of a stream
(the last chunk carries the finish reason).
"""

import json
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser, PydanticToolsParser,
)


def _cut(result) -> bool:
    message = getattr(result[0], "message", None)
    return getattr(message, "response_metadata", {}).get("finish_reason") == "length"


def _cut_error(cause: Any = None) -> OutputParserException:
    detail = f" ({cause})" if cause else ""
    return OutputParserException(
        "the structured output was cut by max_tokens before it was complete "
        f"(finish_reason 'length'); raise max_tokens{detail}")


class _SaysWhenCut:
    """Once the output is known to be cut, the result must be complete or it raises."""

    def parse_result(self, result, *, partial: bool = False):
        if not _cut(result):
            return super().parse_result(result, partial=partial)
        try:
            parsed = super().parse_result(result, partial=False)
        except OutputParserException as error:
            raise _cut_error(error) from error
        if not self._complete(result, parsed):
            raise _cut_error()
        return parsed


class _JsonText:
    @staticmethod
    def _complete(result, parsed) -> bool:
        """LangChain's JSON parsing completes a cut object; strict JSON does not."""
        try:
            json.loads(result[0].text)
        except ValueError:
            return False
        return True


class _ToolCall:
    @staticmethod
    def _complete(result, parsed) -> bool:
        return parsed not in (None, [])  # a cut call is an invalid call: none parsed


class CutAwareJsonParser(_SaysWhenCut, _JsonText, JsonOutputParser):
    pass


class CutAwarePydanticParser(_SaysWhenCut, _JsonText, PydanticOutputParser):
    pass


class CutAwareToolArgsParser(_SaysWhenCut, _ToolCall, JsonOutputKeyToolsParser):
    pass


class CutAwarePydanticToolsParser(_SaysWhenCut, _ToolCall, PydanticToolsParser):
    pass
