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

from collections import deque
from collections.abc import Callable

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "deepseek_v3")


def end_token_id(tokenizer) -> int | None:
    """The id of `</think>` where the tokenizer has it as one token (DeepSeek's R1 and V3.1
    tokenizers), else None."""
    if tokenizer is None:
        return None
    end = tokenizer.convert_tokens_to_ids(END)
    return end if isinstance(end, int) and tokenizer.convert_ids_to_tokens(end) == END else None


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

    @property
    def phase(self) -> str:
        return self._phase

    @property
    def held(self) -> int:
        """Characters fed and not yet decided."""
        return len(self._pending)


class TokenMask:
    """Which of one choice's tokens a response that leaves its reasoning out (include_reasoning
    false) may still show, with their logprobs and ids: the hidden reasoning must not be readable
    from them. Each token's text (`token_str`) goes through a ThinkParser token by token; as the
    parser decides its characters (reasoning, content, or a tag's), the token is decided: left
    out when any of its characters is reasoning and none is content (a tag's own tokens are
    shown). A token without text counts as reasoning until the content begins. A token whose
    text the parser holds back (a possible "</think>": "<", "</th") waits until the parser
    decides it, so `feed` decides the oldest undecided tokens, as many as it can (with `final`:
    every one). Fed the same tokens, whole or in any chunks, it decides the same."""

    def __init__(self, token_str: Callable[[int], str]) -> None:
        self._token_str, self._parser = token_str, ThinkParser()
        self._runs: deque[list] = deque()  # decided characters not yet matched to tokens: [kind, count]
        self._open: deque[list] = deque()  # undecided tokens: [characters left, any reasoning, any content]

    def feed(self, token_ids: list[int], final: bool = False) -> list[bool]:
        """Decisions (True: shown) for the oldest undecided tokens, in order, after these."""
        p = self._parser
        for tid in token_ids:
            text = self._token_str(tid)
            phase, held = p.phase, p.held
            r, c = p.feed(text)
            # a token without text (an id past the tokenizer's vocabulary decodes to "") is
            # decided by where it stands: reasoning unless the content has begun
            self._open.append([len(text), not text and p.phase != "content", False])
            # decided now, in order: a start tag, reasoning, the end tag, content
            tags = held + len(text) - p.held - len(r) - len(c)
            end = len(END) if phase != "content" and p.phase == "content" else 0
            self._runs.extend([["t", tags - end], ["r", len(r)], ["t", end], ["c", len(c)]])
        if final:
            r, c = p.finish()
            self._runs.extend([["r", len(r)], ["c", len(c)]])
        return self._decide()

    def _decide(self) -> list[bool]:
        out = []
        while self._open:
            tok = self._open[0]
            while tok[0] and self._runs:
                run = self._runs[0]
                n = min(tok[0], run[1])
                if n:
                    tok[1] |= run[0] == "r"
                    tok[2] |= run[0] == "c"
                tok[0] -= n
                run[1] -= n
                if not run[1]:
                    self._runs.popleft()
            if tok[0]:
                break  # some of its characters are still held back
            self._open.popleft()
            out.append(tok[2] or not tok[1])
        return out


def split_reasoning(text: str) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output, None for an empty part (as vLLM)."""
    p = ThinkParser()
    r1, c1 = p.feed(text)
    r2, c2 = p.finish()
    return (r1 + r2) or None, (c1 + c2) or None
