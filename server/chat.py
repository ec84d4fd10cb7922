"""`POST /v1/chat/completions`: the tokenizer's chat template, then one engine request."""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.outputs import CompletionOutput, RequestOutput
from scheduler.outputs import TokenLogprobs
from server.completions import finite, sse, start_streams
from server.errors import APIError, error_body, param_of
from server.protocol import ChatCompletionRequest
from server.reasoning import ThinkParser, split_reasoning, thinks
from server.streams import ClientDisconnected, EngineStreams, until_disconnect

logger = logging.getLogger(__name__)


def encode(tokenizer, text: str, field: str, add_special_tokens: bool) -> list[int]:
    """Token ids of `text`; a tokenizer failure is a 400 naming the field."""
    try:
        return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]
    except Exception as e:  # noqa: BLE001 - the tokenizer refused this input (TypeError, ...)
        raise APIError(400, f"{field}: the tokenizer cannot encode it ({type(e).__name__})",
                       param=field) from None


def _reserved_template_kwargs(tokenizer) -> set[str]:
    """apply_chat_template's own parameters: a request's chat_template_kwargs may not set them
    (`tokenize`, `chat_template`, `add_generation_prompt`, ...)."""
    return set(inspect.signature(tokenizer.apply_chat_template).parameters) - {"kwargs"}


def chat_prompt_ids(tokenizer, conversation: list[dict], add_generation_prompt: bool,
                    check_length=None, template_kwargs: dict | None = None) -> list[int]:
    """Render the chat template and tokenize it without adding special tokens a second time.

    `template_kwargs` are extra template variables (chat_template_kwargs). `check_length(text,
    field)` may refuse the rendered text (ValueError) before tokenizing it. Blocking: call it off
    the event loop."""
    if tokenizer is None:
        raise APIError(400, "this server has no tokenizer (--skip-tokenizer-init, or none in the "
                       "model directory): chat needs one; use /v1/completions with token ids",
                       param="messages")
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    template_kwargs = template_kwargs or {}
    reserved = sorted(set(template_kwargs) & _reserved_template_kwargs(tokenizer))
    if reserved:
        raise APIError(400, f"chat_template_kwargs: {', '.join(reserved)} cannot be set here "
                       "(a parameter of the chat template call itself)",
                       param="chat_template_kwargs")
    try:
        text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                             add_generation_prompt=add_generation_prompt,
                                             **template_kwargs)
    except Exception as e:  # jinja raises on conversations the template refuses
        raise APIError(400, f"messages: the chat template refused them: {e}",
                       param="messages") from None
    if check_length is not None:
        try:
            check_length(text, "messages")
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
    return encode(tokenizer, text, "messages", add_special_tokens=False)


class ChatBuilder:
    """OpenAI chat choices and stream deltas from engine outputs."""

    def __init__(self, state, req: ChatCompletionRequest) -> None:
        self.state, self.req = state, req
        self._sent_text: dict[int, int] = {}
        self._finish_sent: set[int] = set()
        # --reasoning-parser: messages carry reasoning fields; `think`: this request's output
        # starts in reasoning, split at </think> (server/reasoning.py)
        self.reasoning = state.reasoning_parser is not None
        self.think = thinks(state.reasoning_parser, req.chat_template_kwargs)
        self._parsers: dict[int, ThinkParser] = {}  # choice index -> its incremental split
        self._num_tokens: dict[int, int] = {}  # choice index -> tokens generated so far

    def chunk_usage(self, index: int, final: RequestOutput) -> dict:
        """Usage so far of choice `index` (continuous_usage_stats, counted as vLLM does)."""
        prompt = len(final.prompt_token_ids)
        completion = self._num_tokens.get(index, 0)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def _entry(self, tid: int, logprob: float) -> dict:
        s = (f"token_id:{tid}" if self.req.return_tokens_as_token_ids
             else self.state.token_str(tid))
        return {"token": s, "logprob": finite(logprob), "bytes": list(s.encode("utf-8"))}

    def logprobs(self, lps: list[TokenLogprobs]) -> dict | None:
        if not self.req.logprobs:
            return None
        k = self.req.top_logprobs or 0
        return {"content": [{**self._entry(lp.token_id, lp.logprob),
                             "top_logprobs": [self._entry(t, v) for t, v in lp.top[:k]]}
                            for lp in lps]}

    def choice(self, index: int, o: CompletionOutput) -> dict:
        message: dict = {"role": "assistant", "content": o.text}
        if self.reasoning:
            reasoning, content = split_reasoning(o.text) if self.think else (None, o.text)
            message = {"role": "assistant", "content": content, "reasoning_content": reasoning,
                       "reasoning": reasoning}
        return {"index": index, "message": message,
                "logprobs": self.logprobs(list(o.logprobs or [])),
                "finish_reason": o.finish_reason}

    def _delta(self, index: int, new_text: str, finished: bool) -> dict:
        """The message delta of new text: content, or reasoning then content when thinking."""
        if not self.think:
            return {"content": new_text} if new_text else {}
        parser = self._parsers.setdefault(index, ThinkParser())
        reasoning, content = parser.feed(new_text)
        if finished:
            tail_reasoning, tail_content = parser.finish()
            reasoning, content = reasoning + tail_reasoning, content + tail_content
        delta = {}
        if reasoning:
            delta["reasoning_content"] = delta["reasoning"] = reasoning
        if content:
            delta["content"] = content
        return delta

    def deltas(self, index: int, o: CompletionOutput) -> list[dict]:
        """Stream deltas for choice `index`: the role first, then new text, then the finish."""
        out = []
        if index not in self._sent_text:
            self._sent_text[index] = 0
            out.append({"index": index, "delta": {"role": "assistant", "content": ""},
                        "logprobs": None, "finish_reason": None})
        new_text = o.delta_text  # not o.text: text held back for stop strings
        new_lps = o.delta_logprobs or []
        self._num_tokens[index] = self._num_tokens.get(index, 0) + len(o.delta_token_ids)
        self._sent_text[index] += len(new_text)
        finish = None if index in self._finish_sent else o.finish_reason
        if finish is not None:  # a finished sample stays in its request's later outputs
            self._finish_sent.add(index)
        if new_text or new_lps or finish is not None:
            # a chunk for every output with new text, even while a possible tag is held back
            out.append({"index": index, "delta": self._delta(index, new_text, finish is not None),
                        "logprobs": self.logprobs(new_lps) if new_lps else None,
                        "finish_reason": finish})
        return out


def _usage(final: RequestOutput | None) -> dict:
    prompt = len(final.prompt_token_ids) if final else 0
    completion = sum(len(o.token_ids) for o in final.outputs) if final else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def create_chat_completion(state, req: ChatCompletionRequest, raw: Request) -> Response:
    """Handle one chat completions request end to end."""
    state.check_model(req.model)
    try:
        params = (await asyncio.to_thread(req.to_sampling_params) if req.asks_for_structure
                  else req.to_sampling_params())
        conversation = req.conversation()
    except ValueError as e:
        raise APIError(400, str(e), param=param_of(str(e))) from None
    state.limits.check(1, req.n, req.stop)
    # template + tokenizer off the event loop: a long conversation must not stall other requests
    prompt_ids = await asyncio.to_thread(chat_prompt_ids, state.tokenizer, conversation,
                                         req.add_generation_prompt, state.check_text_length,
                                         req.template_kwargs())
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    tracker = state.metrics.tracker()
    try:
        streams = await start_streams(state, raw, [prompt_ids], params, request_id)
    except ClientDisconnected:
        return Response(status_code=499)
    builder = ChatBuilder(state, req)
    head = {"id": request_id, "created": int(time.time()), "model": state.model_name}
    if req.stream:
        return StreamingResponse(_sse(streams, builder, head, tracker, req),
                                 media_type="text/event-stream")
    try:
        final = await until_disconnect(raw, _collect(streams, tracker))
    except ClientDisconnected:
        return Response(status_code=499)
    finally:
        streams.close()
        tracker.close(req.n)
    choices = [builder.choice(o.index, o) for o in sorted(final.outputs, key=lambda o: o.index)]
    return JSONResponse({**head, "object": "chat.completion", "choices": choices,
                         "usage": _usage(final)})


async def _collect(streams: EngineStreams, tracker) -> RequestOutput:
    final = None
    async for i, out in streams:
        tracker.observe(i, out)
        final = out
    if final is None or not final.finished:
        raise RuntimeError("engine stream ended without a finished output")
    return final


async def _sse(streams: EngineStreams, builder: ChatBuilder, head: dict, tracker,
               req: ChatCompletionRequest) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk"}
    final = None
    try:
        try:
            async for i, out in streams:
                tracker.observe(i, out)
                final = out
                for o in out.outputs:
                    for delta in builder.deltas(o.index, o):
                        usage = builder.chunk_usage(o.index, out) if req.continuous_usage else None
                        yield sse({**head, "choices": [delta], "usage": usage})
            if req.include_usage:
                yield sse({**head, "choices": [], "usage": _usage(final)})
        except Exception as e:  # headers are gone: report in-band
            logger.exception("stream %s failed", head["id"])
            yield sse(error_body(500, f"internal server error ({type(e).__name__})"))
        yield sse("[DONE]")
    finally:
        streams.close()
        tracker.close(req.n)
