"""Launch-time stand-ins for two checkpoint files, as vLLM reads them: `--chat-template` (instead
of the tokenizer's template) and `--generation-config` (the sampling defaults of requests).

Both are read once at startup; a bad value is a ValueError naming the flag.
"""

from __future__ import annotations

import json
import os

# characters that make a --chat-template value a template rather than a path (vLLM's test)
_JINJA_CHARS = "{}\n"

# generation_config.json keys used as request defaults -> the request field each sets
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                       "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                       "max_new_tokens": "max_tokens"}


def load_chat_template(value: str | None) -> str | None:
    """The template text of --chat-template: a file's contents, or the value itself when it
    holds Jinja characters; None when the flag is not given."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            text = f.read()
    elif any(c in value for c in _JINJA_CHARS):
        text = value
    else:
        raise ValueError(f"--chat-template: no such file: {value} (an inline template must contain "
                         "Jinja markup)")
    # compiled once here, as transformers compiles chat templates (its extensions, e.g. the
    # generation tag): a syntax error is the flag's at start-up, not every chat request's 400
    from jinja2 import TemplateSyntaxError
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template as compile_template
    except ImportError:  # a transformers without it: plain Jinja with its loop controls
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def compile_template(t):
            return ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).from_string(t)
    try:
        compile_template(text)
    except TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from None
    return text


def load_generation_defaults(value: str, model_dir: str | None, override: str | None = None) -> dict:
    """Request defaults from generation_config.json: `auto` reads the model directory's (none
    there: no defaults), `vllm` uses none, anything else names a directory holding one; then
    `override` (--override-generation-config, a JSON object of the same keys) on top, as in vLLM."""
    defaults = _file_defaults(value, model_dir)
    if override is None:
        return defaults
    flag = "--override-generation-config"
    try:
        config = json.loads(override)
    except ValueError as e:
        raise ValueError(f"{flag}: not valid JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f'{flag}: must be a JSON object, e.g. {{"temperature": 0.6}}')
    unknown = sorted(set(config) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"{flag}: unknown key(s) {unknown}; supported: {sorted(GENERATION_DEFAULTS)}")
    merged = {**defaults, **_defaults_from(config, flag)}
    _check_ranges(merged, flag)
    return merged


def _file_defaults(value: str, model_dir: str | None) -> dict:
    if value == "vllm":
        return {}
    if value == "auto":
        if model_dir is None:
            return {}
        path = os.path.join(model_dir, "generation_config.json")
        if not os.path.isfile(path):
            return {}
    else:
        path = os.path.join(value, "generation_config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--generation-config: no generation_config.json in {value} "
                             "(give a directory, `auto` or `vllm`)")
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--generation-config: cannot read {path}: {e}") from None
    defaults = _defaults_from(config if isinstance(config, dict) else {}, f"--generation-config: {path}")
    _check_ranges(defaults, f"--generation-config: {path}")
    return defaults


def _defaults_from(config: dict, source: str) -> dict:
    """The request fields a generation config's keys set (GENERATION_DEFAULTS)."""
    defaults = {}
    for key, field in GENERATION_DEFAULTS.items():
        v = config.get(key)
        if v is None:
            continue
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ValueError(f"{source}: {key} must be a number, got {v!r}")
        defaults[field] = int(v) if field in ("top_k", "max_tokens") else float(v)
    return defaults


def _check_ranges(defaults: dict, source: str) -> None:
    """The defaults must be values a request could send (the same limits), each reported by
    its generation_config.json key (max_new_tokens, not the request's max_tokens)."""
    from pydantic import ValidationError

    from server.protocol import CompletionRequest
    keys = {field: key for key, field in GENERATION_DEFAULTS.items()}
    for field, v in defaults.items():
        if field == "max_tokens" and v < 1:  # a request's 0 means echo only: no default
            raise ValueError(f"{source}: max_new_tokens must be >= 1, got {v}")
        try:
            CompletionRequest(prompt="x", **{field: v})
        except ValidationError as e:
            msg = e.errors()[0]["msg"].removeprefix("Value error, ")
            raise ValueError(f"{source}: {keys[field]}: {msg} (got {v!r})") from None
