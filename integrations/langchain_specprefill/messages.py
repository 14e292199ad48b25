"""LangChain messages to the {"role", "content"} dicts chat templates take."""

import json

from langchain_core.messages import (
    AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage,
)


def _text(content) -> str:
    """Text of a message whose content may be a list of content blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
    return "".join(parts)


def to_chat_messages(messages: list[BaseMessage]) -> list[dict]:
    chat = []
    for message in messages:
        if isinstance(message, SystemMessage):
            chat.append({"role": "system", "content": _text(message.content)})
        elif isinstance(message, HumanMessage):
            chat.append({"role": "user", "content": _text(message.content)})
        elif isinstance(message, AIMessage):
            entry = {"role": "assistant", "content": _text(message.content)}
            if message.tool_calls:
                entry["tool_calls"] = [
                    {"id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": json.dumps(call["args"])}}
                    for call in message.tool_calls
                ]
            chat.append(entry)
        elif isinstance(message, ToolMessage):
            chat.append({"role": "tool", "content": _text(message.content),
                         "tool_call_id": message.tool_call_id})
        elif isinstance(message, ChatMessage):
            chat.append({"role": message.role, "content": _text(message.content)})
        else:
            raise TypeError(f"unsupported message type: {type(message).__name__}")
    return chat
