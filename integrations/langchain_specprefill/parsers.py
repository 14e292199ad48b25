"""Structured-output parsers that say when max_tokens cut the output.

Constrained decoding makes every complete output parse; an output cut by
max_tokens (finish_reason "length") does not, and LangChain's parsers would report a
JSON error, or for tool calls return None as if the model had called nothing. These
subclasses raise an OutputParserException naming the cut instead, also at the end of
a stream (the last chunk carries the finish reason).
"""

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
    def parse_result(self, result, *, partial: bool = False):
        if partial and not _cut(result):
            return super().parse_result(result, partial=True)
        try:
            parsed = super().parse_result(result, partial=False)
        except OutputParserException as error:
            if _cut(result):
                raise _cut_error(error) from error
            raise
        if _cut(result) and parsed in (None, []):  # a cut call is an invalid call
            raise _cut_error()
        return parsed


class CutAwareJsonParser(_SaysWhenCut, JsonOutputParser):
    pass


class CutAwarePydanticParser(_SaysWhenCut, PydanticOutputParser):
    pass


class CutAwareToolArgsParser(_SaysWhenCut, JsonOutputKeyToolsParser):
    pass


class CutAwarePydanticToolsParser(_SaysWhenCut, PydanticToolsParser):
    pass

