"""LangChain messages to the {"role", "content"} dicts chat templates take."""

from langchain_core.messages import (
    AIMessage, BaseMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage,
)

# Content blocks a text-only model cannot take (LangChain v0 and v1 block types).
NON_TEXT_BLOCKS = {"image", "image_url", "input_image", "audio", "input_audio", "video",
                   "file", "document"}


class UnsupportedContentError(ValueError):
    """A message carries content (an image, audio, a file) the model cannot read."""


def _text(content, role: str) -> str:
    """Text of a message whose content may be a list of content blocks."""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict):
            kind = block.get("type")
            if kind == "text":
                parts.append(block.get("text", ""))
            elif kind in NON_TEXT_BLOCKS:
                raise UnsupportedContentError(
                    f"a {role} message has a {kind!r} content block, but ChatSpecPrefill "
                    "serves text-only models (mlx-vlm models too run text-only requests); "
                    "send text, or describe the image in words")
            # reasoning, tool_call and other non-content blocks carry no prompt text
    return "".join(parts)


def to_chat_messages(messages: list[BaseMessage]) -> list[dict]:
    chat = []
    for message in messages:
        if isinstance(message, SystemMessage):
            chat.append({"role": "system", "content": _text(message.content, "system")})
        elif isinstance(message, HumanMessage):
            chat.append({"role": "user", "content": _text(message.content, "user")})
        elif isinstance(message, AIMessage):
            entry = {"role": "assistant", "content": _text(message.content, "assistant")}
            if message.tool_calls:  # arguments as objects; the renderer adapts them
                entry["tool_calls"] = [
                    {"id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": call["args"]}}
                    for call in message.tool_calls
                ]
            chat.append(entry)
        elif isinstance(message, ToolMessage):
            chat.append({"role": "tool", "content": _text(message.content, "tool"),
                         "tool_call_id": message.tool_call_id})
        elif isinstance(message, ChatMessage):
            chat.append({"role": message.role, "content": _text(message.content, message.role)})
        else:
            raise TypeError(f"unsupported message type: {type(message).__name__}")
    return chat
