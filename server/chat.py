"""`POST /v1/chat/completions`: the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

from fastapi import Request
from fastapi.responses import Response

from common.offload import large_lane, off_loop, text_chars
from common.sampling_params import SamplingParams
from engine.outputs import CompletionOutput, RequestOutput
from scheduler.outputs import TokenLogprobs
from server.chat_protocol import ChatCompletionRequest
from server.completions import prompt_logprob_rows
from server.errors import APIError, param_of
from server.frontend_options import reserved_template_kwargs
from server.handler import finite, respond, response_id, sampling_params, usage_of
from server.reasoning import ThinkParser, TokenMask, split_reasoning, thinks
from server.tool_calls import Delta, ToolCallParser, call_id, forced_calls, parse_tool_calls

try:
    from transformers.utils.chat_template_utils import render_jinja_template
except ImportError:  # older transformers: apply_chat_template renders the messages as they are
    render_jinja_template = None

logger = logging.getLogger(__name__)


def encode(tokenizer, text: str, field: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; a tokenizer failure is a 400 naming the field."""
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:  # noqa: BLE001 - the tokenizer refused this input (TypeError, ...)
        raise APIError(400, f"{field}: the tokenizer cannot encode it ({type(e).__name__})",
                       param=field) from None


def render_chat_template(tokenizer, conversation: list[dict], add_generation_prompt: bool,
                         tools: list[dict] | None, chat_template: str | None,
                         template_kwargs: dict) -> str:
    """The chat template's text for `conversation`, its None values kept. transformers 5's
    apply_chat_template drops every message key whose value is None before rendering; DeepSeek's
    templates render an assistant turn of tool calls under `message['content'] is none` and fail
    on a turn without the key (R1's, given "" in its place, would drop the calls). So the
    template is rendered here by transformers' own renderer, with the tokenizer's special tokens
    as apply_chat_template passes them. transformers releases without that renderer keep the
    Nones in apply_chat_template."""
    if render_jinja_template is None:
        return tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             tools=tools, chat_template=chat_template,
                                             **template_kwargs)
    rendered, _ = render_jinja_template(
        conversations=[conversation], tools=tools,
        chat_template=tokenizer.get_chat_template(chat_template, tools),
        add_generation_prompt=add_generation_prompt,
        **{**tokenizer.special_tokens_map, **template_kwargs})
    return rendered[0]


def chat_prompt_ids(tokenizer, conversation: list[dict], add_generation_prompt: bool,
                    check_length=None, template_kwargs: dict | None = None,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    continue_final_message: bool = False, add_special_tokens: bool = False,
                    ) -> list[int]:
    """Render the chat template and tokenize it, by default without adding special tokens a
    second time (the template writes its BOS; `add_special_tokens`: vLLM's field adds them).

    `template_kwargs` are extra template variables (chat_template_kwargs); `tools` the request's
    tools, which the template renders into the prompt; `chat_template` replaces the tokenizer's
    (--chat-template); `continue_final_message` renders the last message without its end of
    turn, so that the output continues it. `check_length(text, field)` may refuse the rendered
    text (ValueError) before tokenizing it. Blocking: call it off the event loop."""
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer (--skip-tokenizer-init, or none in the "
                       "model directory): chat needs one; use /v1/completions with token ids",
                       param="messages")
    if not chat_template and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & reserved_template_kwargs(tokenizer))
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set here "
                       "(a parameter of the chat template call itself)",
                       param="chat_template_kwargs")
    if continue_final_message:  # passed only when asked: older tokenizers lack the parameter
        template_kwargs = {**template_kwargs, "continue_final_message": True}
    try:
        text = render_chat_template(tokenizer, conversation, add_generation_prompt, tools,
                                    chat_template, template_kwargs)
    except Exception as e:  # jinja raises on conversations the template refuses
        raise APIError(400, f"messages: the chat template refused them: {e}",
                       param="messages") from None
    if check_length is not None:
        try:
            check_length(text, "messages")
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    return encode(tokenizer, text, "messages", add_special_tokens=add_special_tokens)


class ChatBuilder:
    """OpenAI chat choices and stream deltas from engine outputs."""

    def __init__(self, state, req: ChatCompletionRequest) -> None:
        self.state, self.req = state, req
        self._sent_text: dict[int, int] = {}
        self._finish_sent: set[int] = set()
        # --reasoning-parser: messages carry reasoning fields; `think`: this request's output
        # starts in reasoning, split at </think> (server/reasoning.py)
        self.role = state.frontend.role(req)
        # echo: the last message's text goes before the output when the response continues it
        last = req.messages[-1]
        self.echoed = last.text() if req.echo and last.role == self.role else ""
        self.reasoning = state.reasoning_parser is not None
        # A forced tool choice constrains the output to JSON from its first token: no reasoning.
        # So does any other constraint where `</think>` is not one token; where it is, the
        # constraint starts after it (chat_inputs), as vLLM's does, and the output reasons first.
        self.think = (thinks(state.reasoning_parser, req.chat_template_kwargs) and req.forced_tool_choice is None
                      and (state.think_end_id is not None or not req.asks_for_structure))
        self._parsers: dict[int, ThinkParser] = {}  # choice index -> its incremental split
        self._num_tokens: dict[int, int] = {}  # choice index -> tokens generated so far
        # tool calls: parsed out of the content (tool_choice "auto" with --tool-call-parser), or
        # the whole output is the constrained JSON of a forced choice ("required", named)
        self.forced = req.forced_tool_choice
        self.tool_parser = (state.tool_call_parser if req.tool_choice == "auto" and req.tools
                            else None)
        self.has_tools = self.forced is not None or self.tool_parser is not None
        self._tool_parsers: dict[int, ToolCallParser] = {}
        self._forced_text: dict[int, str] = {}  # choice index -> constrained output so far
        self._called: set[int] = set()  # choice indices whose calls the auto parser found
        # include_reasoning false with logprobs or return_token_ids: each choice's tokens go through
        # a TokenMask, and a stream holds back those it has not decided yet ((id, logprobs) each)
        self._hides = self.think and not req.include_reasoning and bool(req.logprobs or req.return_token_ids)
        self._masks: dict[int, TokenMask] = {}
        self._undecided: dict[int, list[tuple[int, TokenLogprobs | None]]] = {}
        self.as_token_ids = state.frontend.as_token_ids(req)  # logprobs name tokens "token_id:N"

    def chunk_usage(self, index: int, final: RequestOutput, completion: int | None = None) -> dict:
        """Usage so far of choice `index` (continuous_usage_stats, counted as vLLM does), or with
        `completion` tokens generated."""
        prompt = len(final.prompt_token_ids)
        completion = self._num_tokens.get(index, 0) if completion is None else completion
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _entry(self, tid: int, logprob: float, sampled: bool) -> dict:
        """One token's logprob entry. With token-id names, as vLLM: a sampled token's bytes are
        still its own, an alternative's those of the "token_id:N" it shows."""
        text = self.state.token_str(tid)
        token = f"token_id:{tid}" if self.as_token_ids else text
        # the token's raw bytes: part of a UTF-8 character where its text is U+FFFD (OpenAI's
        # bytes join into the text; vLLM's are U+FFFD's)
        raw = self.state.token_bytes(tid) if sampled or not self.as_token_ids else token.encode("utf-8")
        return {"token": token, "logprob": finite(logprob), "bytes": list(raw)}

    def logprobs(self, lps: list[TokenLogprobs]) -> dict | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        return {"content": [{**self._entry(lp.token_id, lp.logprob, True),
                             "top_logprobs": [self._entry(t, v, False) for t, v in lp.top[:k]]}
                            for lp in lps]}

    def _finish_reason(self, index: int, reason: str | None) -> str | None:
        """"tool_calls" for an output that stopped after calls were found in it (the auto parser's,
        or "required"'s JSON array); a named choice's call keeps "stop", and a cut output "length"
        (vLLM's and OpenAI's)."""
        return "tool_calls" if reason == "stop" and index in self._called else reason

    def choice(self, index: int, o: CompletionOutput) -> dict:
        message: dict = {"role": self.role, "content": o.text}
        if self.reasoning:
            reasoning, content = split_reasoning(o.text) if self.think else (None, o.text)
            reasoning = reasoning if self.req.include_reasoning else None
            message = {"role": self.role, "content": content, "reasoning_content": reasoning,
                       "reasoning": reasoning}
        if isinstance(self.forced, dict):  # named: the output is the call's arguments, cut short or not
            message["content"] = None
            message["tool_calls"] = [{"id": call_id(), "type": "function",
                                      "function": {"name": self.forced["function"]["name"], "arguments": o.text}}]
        elif self.forced is not None:  # required: the calls once their JSON array is complete
            calls = forced_calls(o.text)
            message["content"] = o.text if calls is None else None
            message["tool_calls"] = calls or []
            if calls:
                self._called.add(index)
        elif self.tool_parser is not None:
            parsed = parse_tool_calls(message["content"] or "", self.tool_parser)
            # parallel_tool_calls false: the first call alone (vLLM's)
            calls = parsed.tool_calls if self.req.parallel_tool_calls else parsed.tool_calls[:1]
            message["content"], message["tool_calls"] = parsed.content, calls
            if parsed.tool_calls:
                self._called.add(index)
        if self.echoed:
            message["content"] = self.echoed + (message["content"] or "")
        ids, lps = self._shown(TokenMask(self.state.token_str), [], list(o.token_ids), list(o.logprobs or []),
                               final=True)
        choice = {"index": index, "message": message, "logprobs": self.logprobs(lps),
                  "finish_reason": self._finish_reason(index, o.finish_reason),
                  "stop_reason": o.stop_reason}
        if self.req.return_token_ids:
            choice["token_ids"] = ids
        return choice

    def _shown(self, mask: TokenMask, undecided: list, ids: list[int], lps: list[TokenLogprobs],
               final: bool) -> tuple[list[int], list[TokenLogprobs]]:
        """The ids and logprobs that include_reasoning false leaves shown (all of them without
        it), out of a choice's `undecided` tokens (updated in place) and these new ones: those
        `mask` decides now, the rest kept for later. A whole answer passes them all with `final`;
        a stream each chunk's, so both show the same tokens whatever the chunks."""
        if not self._hides:
            return ids, lps
        undecided += zip(ids, _aligned(lps, ids))
        keep = mask.feed(ids, final)
        decided, undecided[:] = undecided[:len(keep)], undecided[len(keep):]
        shown = [item for item, k in zip(decided, keep) if k]
        return [t for t, _ in shown], [lp for _, lp in shown if lp is not None]

    def _delta(self, index: int, new_text: str, finished: bool) -> tuple[dict, bool]:
        """The message delta of new text: content, or reasoning then content when thinking;
        tool calls out of the content when the request has tools. Second: whether the text was
        all reasoning that include_reasoning false leaves out (the delta is then empty), or text
        the parser holds back while still in the reasoning (a chunk for it would tell how often
        the hidden reasoning holds a possible tag's start, "<" or "</")."""
        reasoning, content, in_reasoning = "", new_text, False
        if self.think:
            parser = self._parsers.setdefault(index, ThinkParser())
            reasoning, content = parser.feed(new_text)
            if finished:
                tail_reasoning, tail_content = parser.finish()
                reasoning, content = reasoning + tail_reasoning, content + tail_content
            in_reasoning = parser.phase != "content"
        delta = {}
        if reasoning and self.req.include_reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        hidden = (bool(reasoning) or in_reasoning) and not self.req.include_reasoning
        calls = []
        if self.has_tools:
            content, calls = self._tool_delta(index, content, finished)
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
            if not isinstance(self.forced, dict):  # auto or "required", not a named choice
                self._called.add(index)
        return delta, hidden and not delta

    def _tool_delta(self, index: int, content: str, finished: bool) -> tuple[str, list[dict]]:
        """(content, delta.tool_calls) of new content: a call's first entry carries its id, type
        and name, later ones argument fragments, each with the call's index."""
        if self.forced is None:
            parser = self._tool_parsers.setdefault(index, ToolCallParser(self.tool_parser))
            d = parser.feed(content)
            if finished:
                d.merge(parser.finish())
            entries = _call_entries(d)
            if not self.req.parallel_tool_calls:  # the first call alone (vLLM's), as whole
                entries = [e for e in entries if e["index"] == 0]
            return d.content, entries
        if isinstance(self.forced, dict):  # named: the output is the arguments
            d = Delta(args=[(0, content)] if content else [])
            if index not in self._forced_text:
                d.calls.append((0, call_id(), self.forced["function"]["name"]))
            self._forced_text[index] = self._forced_text.get(index, "") + content
            return "", _call_entries(d)
        # required: a JSON array of calls, sent once it is complete
        text = self._forced_text[index] = self._forced_text.get(index, "") + content
        if not finished:
            return "", []
        calls = forced_calls(text)
        if calls is None:
            return text, []
        return "", [{"index": i, **c} for i, c in enumerate(calls)]

    def deltas(self, index: int, o: CompletionOutput) -> list[dict]:
        """Stream deltas for choice `index`: the role first (and the echoed message), then new
        text, then the finish."""
        out = []
        if index not in self._sent_text:
            self._sent_text[index] = 0
            out.append({"index": index, "delta": {"role": self.role, "content": ""},
                        "logprobs": None, "finish_reason": None})
            if self.echoed:
                out.append({"index": index, "delta": {"content": self.echoed}, "logprobs": None,
                            "finish_reason": None})
        new_text = o.delta_text  # not o.text: text held back for stop strings
        new_lps = o.delta_logprobs or []
        self._num_tokens[index] = self._num_tokens.get(index, 0) + len(o.delta_token_ids)
        self._sent_text[index] += len(new_text)
        finish = None if index in self._finish_sent else o.finish_reason
        if finish is not None:  # a finished sample stays in its request's later outputs
            self._finish_sent.add(index)
        delta, hidden = self._delta(index, new_text, finish is not None) if new_text or finish is not None \
            else ({}, False)
        # A chunk for every output with new text, even while a possible tag is held back (an
        # empty delta), and with logprobs; none for reasoning that include_reasoning false leaves
        # out, nor for text held back inside it (its logprobs and ids neither), as vLLM sends
        # none; with return_token_ids or logprobs for every output with tokens shown.
        shown_ids, shown = self._shown(self._masks.setdefault(index, TokenMask(self.state.token_str)),
                                       self._undecided.setdefault(index, []), list(o.delta_token_ids),
                                       list(new_lps), final=finish is not None)
        new_ids = shown_ids if self.req.return_token_ids else []
        if (new_text and not hidden) or shown or new_ids or finish is not None:
            out.append({"index": index, "delta": delta,
                        "logprobs": self.logprobs(shown) if shown else None,
                        "finish_reason": self._finish_reason(index, finish),
                        "stop_reason": None if finish is None else o.stop_reason})
            if self.req.return_token_ids:
                out[-1]["token_ids"] = new_ids
        return out

    def choices(self, finals: list[RequestOutput]) -> list[dict]:
        return [self.choice(o.index, o) for o in sorted(finals[0].outputs, key=lambda o: o.index)]

    def usage(self, finals: list[RequestOutput | None]) -> dict:
        final = finals[0]
        prompt = len(final.prompt_token_ids) if final else 0
        completion = sum(len(o.token_ids) for o in final.outputs) if final else 0
        return usage_of(self.state, prompt, completion, finals)

    def chunks(self, i: int, out: RequestOutput) -> Iterator[tuple[dict, dict, dict]]:
        for o in out.outputs:
            before = self._num_tokens.get(o.index, 0)
            for delta in self.deltas(o.index, o):
                # the prompt's ids ride with each choice's role chunk (vLLM's)
                top = ({"prompt_token_ids": list(out.prompt_token_ids)}
                       if self.req.return_token_ids and "role" in delta["delta"] else {})
                # the role chunk and the echoed message (the chunks without a stop_reason) go
                # before this output's tokens: their usage does not count them (vLLM's 0)
                head = "stop_reason" not in delta
                yield delta, self.chunk_usage(o.index, out, before if head else None), top

    def response_fields(self, finals: list[RequestOutput]) -> dict:
        fields = {}
        if self.req.prompt_logprobs is not None:
            fields["prompt_logprobs"] = prompt_logprob_rows(self.state, finals[0], self.req.prompt_logprobs)
        if self.req.return_token_ids:
            fields["prompt_token_ids"] = list(finals[0].prompt_token_ids)
        return fields


def _call_entries(d: Delta) -> list[dict]:
    """delta.tool_calls entries of a Delta, one per call index (a new call's first fragment of
    arguments rides with its name)."""
    entries: dict[int, dict] = {}
    for i, cid, name in d.calls:
        entries[i] = {"index": i, "id": cid, "type": "function",
                      "function": {"name": name, "arguments": ""}}
    for i, frag in d.args:
        entry = entries.setdefault(i, {"index": i, "function": {"arguments": ""}})
        entry["function"]["arguments"] += frag
    return [entries[i] for i in sorted(entries)]


# chats of more messages build their conversation on a worker thread
MANY_MESSAGES = 4096


async def create_chat_completion(state, req: ChatCompletionRequest, raw: Request) -> Response:
    """Handle one chat completions request end to end (server/handler.py)."""
    params, prompt_ids = await chat_inputs(state, req)
    return await respond(state, raw, req, [prompt_ids], params, response_id("chatcmpl-", raw, req),
                         ChatBuilder(state, req), "chat.completion", "chat.completion.chunk")


async def chat_inputs(state, req: ChatCompletionRequest) -> tuple[SamplingParams, list[int]]:
    """A chat request's sampling parameters and rendered prompt, every check done (APIError):
    what chat completions and the Responses route (server/responses.py) run."""
    state.check_model(req.model)
    req.apply_defaults(state.request_defaults)
    req.chat_template_kwargs = state.frontend.template_kwargs(req.chat_template_kwargs)
    params = await sampling_params(req, state.tokenizer)
    so = params.structured_outputs
    if (so is not None and req.forced_tool_choice is None and state.think_end_id is not None
            and thinks(state.reasoning_parser, req.chat_template_kwargs)):
        # the output reasons first: its constraint holds from the token after `</think>` on
        params = dataclasses.replace(params, structured_outputs=dataclasses.replace(so, start_after=state.think_end_id))
    try:  # a long chat's turns are built off the event loop (450,000 messages: 0.25 s)
        conversation = (req.conversation() if len(req.messages) <= MANY_MESSAGES
                        else await large_lane(req.conversation))
    except ValueError as e:
        raise APIError(400, str(e), param=param_of(str(e))) from None
    if req.tool_choice == "auto" and req.tools and state.tool_call_parser is None:
        raise APIError(400, 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice '
                       'and --tool-call-parser to be set', param="tool_choice")
    if req.tool_choice == "auto" and req.tools:
        # The parser reads the tool-call markers from the decoded text, and a tokenizer may mark
        # those added tokens special: keep them in the text, as vLLM does for tool requests.
        params = dataclasses.replace(params, skip_special_tokens=False)
    state.limits.check(1, req.n, req.stop, {"top_logprobs": req.top_logprobs,
                                             "prompt_logprobs": req.prompt_logprobs})
    # template + tokenizer off the event loop: a long conversation must not stall other requests
    prompt_ids = await off_loop(text_chars(conversation), chat_prompt_ids, state.tokenizer, conversation,
                                req.add_generation_prompt, state.check_text_length,
                                req.template_kwargs(), req.tool_dicts(),
                                state.chat_template, req.continue_final_message,
                                req.add_special_tokens)
    state.limits.check_prompt_logprobs([prompt_ids], req.prompt_logprobs, "prompt_logprobs")  # once a response
    return params, prompt_ids


def _aligned(lps: list[TokenLogprobs], ids: list[int]) -> list[TokenLogprobs | None]:
    """The logprobs entry of each token of `ids` (None where it has none): position by position
    when there is one a token; else each entry matched to its token in order (the engine leaves
    out a token's entry where it has none)."""
    if len(lps) == len(ids):
        return lps
    out: list[TokenLogprobs | None] = [None] * len(ids)
    j = 0
    for lp in lps:
        while j < len(ids) and ids[j] != lp.token_id:
            j += 1
        if j < len(ids):
            out[j] = lp
        j += 1
    return out
