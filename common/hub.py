"""Model names as vLLM takes them: a local directory, or a Hugging Face Hub repository id
(`deepseek-ai/DeepSeek-V2-Lite-Chat`), fetched into the Hub's cache (or `--download-dir`) with
huggingface_hub, as `vllm serve REPO_ID` does. Only what the engine reads is fetched: configs,
safetensors shards, tokenizer and template files. With HF_HUB_OFFLINE=1 the cache alone is used.
"""

from __future__ import annotations

import os
import re

# what the engine reads from a checkpoint (no .bin / .pt weights: it loads safetensors only)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def is_repo_id(name: str) -> bool:
    """`org/name` that is not a local path: what vLLM reads as a Hub repository."""
    return bool(_REPO_ID.match(name)) and not os.path.exists(name)


def resolve_model_dir(name: str, flag: str, revision: str | None = None,
                      download_dir: str | None = None, token: str | None = None,
                      weights: bool = True) -> str:
    """`name` itself when it is not a repository id, else the local snapshot of that repository
    (fetched if the cache lacks it; `weights` False: without the safetensors shards, for
    --load-format dummy and tokenizers); ValueError naming `flag` when that fails."""
    if not is_repo_id(name):
        return name
    patterns = ALLOW_PATTERNS if weights else [p for p in ALLOW_PATTERNS if p != "*.safetensors"]
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(name, revision=revision, cache_dir=download_dir, token=token,
                                 allow_patterns=patterns)
    except Exception as e:  # noqa: BLE001 - no network, no such repo, gated, not cached offline
        offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False")
        hint = " (HF_HUB_OFFLINE is set: only the local cache is read)" if offline else ""
        raise ValueError(f"{flag} {name}: not a local directory, and fetching it from the Hugging "
                         f"Face Hub failed{hint}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                         ) from None
