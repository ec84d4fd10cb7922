"""Tool calls: DeepSeek's tool-call markup parsed out of chat output (`--tool-call-parser`), and
the JSON constraint that forces a call for `tool_choice` "required" or a named function.

DeepSeek-V3 writes (its chat template and vLLM's `deepseek_v3` parser):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nARGS\\n```<｜tool▁call▁end｜>
    \\n<｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

DeepSeek-V3.1 (`deepseek_v31`) drops the type and the code fence, with nothing between calls:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the block is the message's content. The parser works on streamed text as
server/reasoning.py does: text that may be the start of a marker is held back until decided, and a
whole output is one chunk, so streamed and whole responses agree. A call exists once its header
(up to the start of its arguments) has arrived intact; a block that breaks the format before that
is left in the content from the point where it broke.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from server.reasoning import _held

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
V3_FENCE = "\n```json\n"


@dataclass(frozen=True)
class Format:
    """Where a call's name and arguments sit between CALL_BEGIN and CALL_END."""

    typed: bool  # "TYPE<sep>NAME" + fence (V3) or "NAME<sep>" (V3.1)
    args_end: str  # what closes the arguments


PARSERS = {
    "deepseek_v3": Format(typed=True, args_end="\n```" + CALL_END),
    "deepseek_v31": Format(typed=False, args_end=CALL_END),
}


def check_parser_name(name: str | None) -> None:
    """ValueError naming the flag and the choices for an unknown parser name."""
    if name is not None and name not in PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r} "
                         f"(choices: {', '.join(PARSERS)})")


def check_tool_flags(enable_auto: bool, parser: str | None) -> str | None:
    """The parser that tool_choice "auto" uses (None: "auto" is refused); ValueError naming the
    flag for an unknown parser or --enable-auto-tool-choice without one."""
    check_parser_name(parser)
    if enable_auto and parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                         f"({', '.join(PARSERS)})")
    return parser if enable_auto else None


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Delta:
    """What one chunk of text decided: content, new calls (index, id, name), argument text."""

    content: str = ""
    calls: list[tuple[int, str, str]] = field(default_factory=list)
    args: list[tuple[int, str]] = field(default_factory=list)  # (call index, fragment)

    def __bool__(self) -> bool:
        return bool(self.content or self.calls or self.args)

    def merge(self, other: Delta) -> Delta:
        self.content += other.content
        self.calls += other.calls
        self.args += other.args
        return self


class ToolCallParser:
    """Incremental split of one choice's text into content and tool calls."""

    def __init__(self, parser: str) -> None:
        self.fmt = PARSERS[parser]
        # "text" -> "calls" (between calls) -> "header" -> "args" -> "calls" ... -> "after";
        # "broken": the block broke the format, the rest is content
        self._phase = "text"
        self._pending = ""
        self.num_calls = 0

    def feed(self, text: str) -> Delta:
        self._pending += text
        out = Delta()
        while True:
            step = getattr(self, f"_{self._phase}")()
            if step is None:
                return out
            out.merge(step)

    def finish(self) -> Delta:
        """Flush at the end of the output: held text was no marker; an unclosed call's arguments
        end where the output ended; a block with no call in it is content."""
        if self._phase == "header":
            self._break()
        rest, self._pending = self._pending, ""
        if self._phase == "args":
            return Delta(args=[(self.num_calls - 1, rest)] if rest else [])
        if self._phase == "calls":
            return Delta(content=CALLS_BEGIN + rest if self.num_calls == 0 else "")
        if self._phase == "after":
            return Delta(content=rest if rest.strip() else "")
        return Delta(content=rest)

    # each phase consumes what it can decide from _pending: a Delta (maybe empty) to go on, or
    # None when it must wait for more text

    def _text(self):
        i = self._pending.find(CALLS_BEGIN)
        if i >= 0:
            content, self._pending = self._pending[:i], self._pending[i + len(CALLS_BEGIN):]
            self._phase = "calls"
            return Delta(content=content)
        cut = len(self._pending) - _held(self._pending, CALLS_BEGIN)
        content, self._pending = self._pending[:cut], self._pending[cut:]
        return Delta(content=content) if content else None

    def _calls(self):
        head = self._pending.lstrip()
        for marker, phase in ((CALL_BEGIN, "header"), (CALLS_END, "after")):
            if head.startswith(marker):
                self._pending, self._phase = head[len(marker):], phase
                return Delta()
        if not head or CALL_BEGIN.startswith(head) or CALLS_END.startswith(head):
            return None
        return self._break()

    def _header(self):
        p = self._pending
        sep = p.find(SEP)
        stop = min((j for j in (p.find(CALL_END), p.find(CALLS_END), p.find(CALL_BEGIN))
                    if j >= 0), default=-1)
        if sep < 0 or (stop >= 0 and stop < sep):
            return self._break() if stop >= 0 else None
        if self.fmt.typed:
            end = p.find(V3_FENCE, sep)
            if end < 0 or (stop >= 0 and stop < end):
                return self._break() if stop >= 0 else None
            name, rest = p[sep + len(SEP):end], p[end + len(V3_FENCE):]
            if "\n" in name:
                return self._break()
        else:
            name, rest = p[:sep], p[sep + len(SEP):]
        name = name.strip()
        if not name:
            return self._break()
        self._pending, self._phase = rest, "args"
        self.num_calls += 1
        return Delta(calls=[(self.num_calls - 1, call_id(), name)])

    def _args(self):
        end = self.fmt.args_end
        i = self._pending.find(end)
        index = self.num_calls - 1
        if i >= 0:
            args, self._pending = self._pending[:i], self._pending[i + len(end):]
            self._phase = "calls"
            return Delta(args=[(index, args)] if args else [])
        cut = len(self._pending) - _held(self._pending, end)
        args, self._pending = self._pending[:cut], self._pending[cut:]
        return Delta(args=[(index, args)]) if args else None

    def _after(self):
        return None  # held to the end: only text that is not whitespace becomes content

    def _broken(self):
        content, self._pending = self._pending, ""
        return Delta(content=content) if content else None

    def _break(self) -> Delta:
        """The block broke the format: it goes to the content from its start (or from the end of
        the last complete call)."""
        start = (CALLS_BEGIN if self.num_calls == 0 else "") + \
            (CALL_BEGIN if self._phase == "header" else "")
        self._pending, self._phase = start + self._pending, "broken"
        return Delta()


@dataclass
class Parsed:
    content: str | None
    tool_calls: list[dict]


def parse_tool_calls(text: str, parser: str) -> Parsed:
    """A whole output's content (None when empty) and OpenAI tool_calls."""
    p = ToolCallParser(parser)
    d = p.feed(text).merge(p.finish())
    return Parsed(d.content or None, assemble(d))


def assemble(d: Delta) -> list[dict]:
    """OpenAI tool_calls from the calls and argument fragments of a Delta."""
    calls = [{"id": cid, "type": "function", "function": {"name": name, "arguments": ""}}
             for _, cid, name in d.calls]
    first = d.calls[0][0] if d.calls else 0
    for i, frag in d.args:
        calls[i - first]["function"]["arguments"] += frag
    return calls


# ---- tool_choice "required" / named: the output is constrained to JSON and becomes the calls ----

def forced_schema(tools: list[dict], choice) -> dict:
    """The JSON schema a forced tool choice constrains the output to: the named function's
    parameters, or (required) an array of {"name", "parameters"} objects, one of the tools each."""
    def params(t: dict) -> dict:
        return t["function"].get("parameters") or {"type": "object"}

    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return params(next(t for t in tools if t["function"]["name"] == name))
    # Each tool's parameters move inside an array schema, so their root-relative definitions
    # ("$ref": "#/$defs/Unit", as Pydantic writes them) move to the new root, merged.
    defs: dict[str, dict] = {}
    items = []
    for t in tools:
        p = dict(params(t))
        for key in ("$defs", "definitions"):
            if not isinstance(p.get(key), dict):
                continue  # absent, or malformed: left where the schema check will name it
            for name, schema in p.pop(key).items():
                if defs.setdefault(key, {}).setdefault(name, schema) != schema:
                    raise ValueError(f"tools: two tools define {key} {name!r} differently; a forced "
                                     f"tool choice puts every tool's definitions in one schema")
        items.append({"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                        "parameters": p},
                      "required": ["name", "parameters"], "additionalProperties": False})
    one_of = items[0] if len(items) == 1 else {"anyOf": items}
    return {"type": "array", "minItems": 1, "items": one_of, **defs}


def forced_calls(text: str) -> list[dict] | None:
    """The tool_calls of `tool_choice: "required"`'s constrained output (a JSON array of
    {"name", "parameters"}); None when it is not complete JSON (stopped by max_tokens)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
        return None
    return [{"id": call_id(), "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}}
            for c in value]
