"""A chat's messages checked and held until a tokenizer thread runs the model's chat template on them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from milestones.server.errors import BadRequest


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A conversation whose shape is checked; called with a tokenizer, it runs the model's chat template and gives
    the token ids ready for the assistant's answer (later, on a thread of the server's that tokenizes; the
    template's errors are still a 400)."""

    messages: list[dict]

    @property
    def chars(self) -> int:
        """The characters of its messages: the template adds a few per turn, never removes any."""
        return sum(len(m["content"]) for m in self.messages)

    def __call__(self, tokenizer: Any) -> list[int]:
        try:
            text = tokenizer.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        except Exception as err:  # the template's own checks (roles that must alternate, ...)
            raise BadRequest(f"the chat template refused the conversation: {err}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)


def chat_prompt(messages: object) -> ChatPrompt:
    """The conversation's messages checked and turned into text turns (see ChatPrompt)."""
    return ChatPrompt([{"role": m["role"], "content": text_content(m, i)}
                       for i, m in enumerate(_message_list(messages))])


def _message_list(messages: object) -> list[dict]:
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': '...'} objects", "messages")
    return messages


def text_content(message: dict, index: int) -> str:
    """A message's content as text: a string, a list of text parts (joined by newlines, as vLLM does), or an
    assistant's null (a turn that only called tools)."""
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"messages[{index}] has a content part of type {kind!r}: this server reads text "
                                 "only; send parts such as {'type': 'text', 'text': '...'}", "messages")
        return "\n".join(part["text"] for part in content)
    if not isinstance(content, str):
        raise BadRequest("messages must be a non-empty list of {'role': ..., 'content': '...'} objects (content: a "
                         f"string or a list of text parts); messages[{index}] has content {content!r}", "messages")
    return content
