"""`serve --config FILE`: flags from a YAML file, as vLLM reads them.

The file is a mapping of flag names (`max-model-len` or `max_model_len`, no dashes in front) to
values. Each entry becomes command-line words put before the command line's own, so a flag given
on both wins from the command line (argparse keeps the last value). A true switch becomes the
flag, a false one nothing (or `--no-flag` for a flag that has that form); a list becomes the
flag followed by its items (for a flag that takes several; a list for a one-value flag is an
error naming it); a mapping becomes its JSON text (`--hf-overrides`, `--speculative-config`).
A name that is no flag of `serve` is reported as the command line's unknown flags are.
"""

from __future__ import annotations

import argparse
import json


def config_path(argv: list[str]) -> tuple[str | None, list[str]]:
    """The `--config` path in `argv` (None without one) and `argv` without it."""
    rest, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise ValueError("--config needs a file path")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return path, rest


def config_args(path: str, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line words of the YAML file at `path`; ValueError naming the file."""
    import yaml  # late: only a launch with --config reads YAML

    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except OSError as e:
        raise ValueError(f"--config {path}: {e.strerror or e}") from None
    except yaml.YAMLError as e:
        raise ValueError(f"--config {path}: not valid YAML ({e})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: the file must be a mapping of flag names to values")
    negatable = {s for a in parser._actions if isinstance(a, argparse.BooleanOptionalAction)
                 for s in a.option_strings}
    words: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if value is True:
            words.append(flag)
        elif value is False:
            if flag in negatable:
                words.append("--no-" + flag[2:])
        elif value is None:
            continue
        elif isinstance(value, list):
            action = parser._option_string_actions.get(flag)
            if action is not None and action.nargs not in ("+", "*") and \
                    not isinstance(action, argparse._AppendAction):
                raise ValueError(f"--config {path}: {key} takes one value, got a list {value!r}")
            words += [flag, *(json.dumps(v) if isinstance(v, (dict, list)) else str(v) for v in value)]
        elif isinstance(value, dict):
            words += [flag, json.dumps(value)]
        else:
            words += [flag, str(value)]
    return words
