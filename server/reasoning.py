"""Reasoning output (`--reasoning-parser`): a chat completion's text split at `</think>` into
`reasoning_content` (also sent as `reasoning`, vLLM's newer name) and `content`.

DeepSeek-R1's chat template ends the prompt with `<think>\\n`, so the model usually emits only
the closing tag: everything before `</think>` is reasoning, a `<think>` at the very start of the
output is dropped, and an output that never closes the tag is reasoning only (vLLM's
`deepseek_r1` parser). `deepseek_v3` (V3.1 and later, hybrid thinking) does the same when the
request passes `chat_template_kwargs: {"thinking": true}`, and otherwise leaves the text as
content.

The parser works on streamed text, chunk by chunk: a tag may arrive split over tokens or stream
chunks, so text that could be the start of a tag is held back until it is decided. Parsing the
whole text at once is feeding it as one chunk, so streamed and whole responses agree.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "deepseek_v3")


def check_parser_name(name: str | None) -> None:
    """ValueError naming the flag and the choices for an unknown parser name."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} "
                         f"(choices: {', '.join(PARSERS)})")


def thinks(parser: str | None, chat_template_kwargs: dict | None) -> bool:
    """Whether this request's output starts in reasoning (`parser` as --reasoning-parser)."""
    if parser == "deepseek_r1":
        return True
    if parser == "deepseek_v3":
        return bool((chat_template_kwargs or {}).get("thinking", False))
    return False


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ThinkParser:
    """Incremental split of one choice's text into (reasoning, content)."""

    def __init__(self) -> None:
        self._phase = "start"  # "start" (a leading <think> may come) -> "reasoning" -> "content"
        self._pending = ""  # text held back: it may still become a tag

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and content decided by this chunk (either may be empty)."""
        self._pending += text
        if self._phase == "start":
            head = self._pending.lstrip()
            if head.startswith(START):
                self._pending, self._phase = head[len(START):], "reasoning"
            elif START.startswith(head):
                return "", ""  # only whitespace or part of "<think>" so far
            else:
                self._phase = "reasoning"
        if self._phase == "content":
            content, self._pending = self._pending, ""
            return "", content
        i = self._pending.find(END)
        if i >= 0:
            reasoning, content = self._pending[:i], self._pending[i + len(END):]
            self._pending, self._phase = "", "content"
            return reasoning, content
        keep = _held(self._pending, END)
        cut = len(self._pending) - keep
        reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return reasoning, ""

    def finish(self) -> tuple[str, str]:
        """Flush what was held back at the end of the output: it was not a tag."""
        rest, self._pending = self._pending, ""
        return ("", rest) if self._phase == "content" else (rest, "")


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output, None for an empty part (as vLLM)."""
    p = ThinkParser()
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2) or None, (c1 + c2) or None
