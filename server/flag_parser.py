"""`serve`'s argument parser and the flag value types it shares with vLLM's CLI."""

from __future__ import annotations

import argparse
import sys

from common.args import human_readable_int
from server.config_file import config_args, config_path


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump), exit code 2.

    As vLLM's parser: `--flag_name` is read as `--flag-name`, and an unknown flag is an error
    naming it (flags are matched exactly, never by abbreviation)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, allow_abbrev=False, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_args(self, args=None, namespace=None):
        given = list(sys.argv[1:] if args is None else args)
        try:  # --config FILE: its flags first, so the command line's own win
            path, given = config_path(given)
            if path is not None:  # after a leading positional model, which must stay first
                head = given[:1] if given and not given[0].startswith("-") else []
                given = head + config_args(path, self) + given[len(head):]
        except ValueError as e:
            self.error(str(e))
        argv = [_dashed(a) for a in given]
        spelled = dict(zip(argv, given))  # report a flag as the user wrote it
        argv = self._explicit_switches(argv)
        ns, extra = self.parse_known_args(argv, namespace)
        flags = [spelled.get(a, a).split("=", 1)[0] for a in extra if a.startswith("-")]
        if flags:
            self.error(f"unsupported flag{'s' if len(flags) > 1 else ''}: {', '.join(flags)} "
                       "(serve takes a subset of vLLM's flags)")
        if extra:
            self.error(f"unexpected argument{'s' if len(extra) > 1 else ''}: {' '.join(extra)}")
        return ns

    def _explicit_switches(self, argv: list[str]) -> list[str]:
        """`--enable-chunked-prefill True` / `=false` (older vLLM's on/off flags took a value)
        -> `--enable-chunked-prefill` / `--no-enable-chunked-prefill`, for every on/off flag
        that has a --no- form; without this the value would be read as the model directory."""
        switches = {s for a in self._actions if isinstance(a, argparse.BooleanOptionalAction)
                    for s in a.option_strings if not s.startswith("--no-")}
        out, i = [], 0
        while i < len(argv):
            a = argv[i]
            name, eq, value = a.partition("=")
            if name in switches and not eq and i + 1 < len(argv) and argv[i + 1].lower() in _ON_OFF:
                value, i = argv[i + 1], i + 1
            if name in switches and value.lower() in _ON_OFF:
                a = name if _ON_OFF[value.lower()] else "--no-" + name[2:]
            out.append(a)
            i += 1
        return out


_ON_OFF = {"true": True, "false": False}


def _dashed(arg: str) -> str:
    """`--max_model_len=8` -> `--max-model-len=8`: vLLM accepts underscores in flag names."""
    if not arg.startswith("--"):
        return arg
    name, eq, value = arg.partition("=")
    return name.replace("_", "-") + eq + value


def token_count(value: str) -> int:
    """A token-count flag's value: an integer or vLLM's human-readable form (32k, 32K)."""
    try:
        return human_readable_int(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not a token count: {e}") from None


def model_len(value: str) -> int | str:
    """--max-model-len: a token count, or `auto` (also vLLM's -1): the longest the KV cache holds."""
    if value.strip().lower() in ("auto", "-1"):
        return "auto"
    n = token_count(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, or auto (-1), got {value!r}")
    return n
