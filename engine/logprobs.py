"""Logprobs on the device: the sampled tokens' (the Sampler's) and the prompt's (prompt_logprobs).

Both are taken from the raw logits' log_softmax and kept as tensors (DeviceLogprobs) until the
step has finished, so reading them never stalls the GPU's queue.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from common.transfer import to_host
from scheduler.outputs import TokenLogprobs
from scheduler.prompt_logprobs import PromptLogprobs


class DeviceLogprobs(Sequence):
    """Logprobs of N rows as a sequence of TokenLogprobs, kept as tensors until first read.

    Building the Python lists waits for the GPU, so the runner starts a non-blocking copy to
    pinned host memory (`copy_to_host`) when it launches a step and reads the rows only once the
    step has finished; anyone else just indexes it.
    """

    def __init__(self, token_ids: torch.Tensor, chosen: torch.Tensor, ranks: torch.Tensor,
                 top_vals: torch.Tensor | None, top_ids: torch.Tensor | None):
        self._tensors = [token_ids, chosen, ranks, top_vals, top_ids]
        self._rows: list[TokenLogprobs] | None = None

    def copy_to_host(self) -> None:
        """Queue the copy back (CUDA: to pinned memory, no host sync); ordered on the stream."""
        if self._rows is None:
            self._tensors = [None if t is None else to_host(t) for t in self._tensors]

    def _materialize(self) -> list[TokenLogprobs]:
        if self._rows is None:
            token_ids, chosen, ranks, top_vals, top_ids = self._tensors
            ids_l, lp_l, rank_l = token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist()
            top_v_l = top_vals.tolist() if top_vals is not None else [[] for _ in ids_l]
            top_i_l = top_ids.tolist() if top_ids is not None else [[] for _ in ids_l]
            self._rows = [TokenLogprobs(token_id=t, logprob=lp, rank=r, top=list(zip(ti, tv)))
                          for t, lp, r, ti, tv in zip(ids_l, lp_l, rank_l, top_i_l, top_v_l)]
            self._tensors = []
        return self._rows

    def __len__(self) -> int:
        return len(self._rows) if self._rows is not None else self._tensors[0].shape[0]

    def prompt_run(self, first: bool) -> PromptLogprobs:
        """These rows as a run of prompt logprobs (columns, no per-row objects), after a None
        for the prompt's first token when `first`. The copy back must be done (the step has
        finished) or the tensors on the CPU."""
        if self._rows is not None:
            return PromptLogprobs.from_entries(([None] if first else []) + self._rows)
        # copied out of the (pinned) staging buffers: the run may outlive the step by far
        token_ids, chosen, ranks, top_vals, top_ids = (None if t is None else t.numpy().copy() for t in self._tensors)
        n = token_ids.shape[0]
        if top_ids is None:
            top_ids, top_vals = np.zeros((n, 0), np.int64), np.zeros((n, 0), np.float32)
        return PromptLogprobs(first, token_ids, chosen.reshape(n), ranks, top_ids, top_vals)

    def __getitem__(self, i):
        return self._materialize()[i]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> DeviceLogprobs:
    """Logprob, rank and top-`num_top` of each row's chosen token. The rank is vLLM's: the
    tokens at least as likely as the chosen one, itself included (1 = most likely, untied)."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs >= chosen).sum(dim=-1)  # [N]
    num_top = min(num_top, logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(num_top, dim=-1) if num_top > 0 else (None, None)
    return DeviceLogprobs(token_ids, chosen, ranks, top_vals, top_ids)


# Bytes per prompt position and vocabulary entry that a chunk's logprobs allocate on one rank:
# the head's logits (2) and their fp32 copy (4), the log_softmax (4) and the rank's comparison
# (1), rounded up. At most ~9 of them are held at once (under TP ~1-2 more: the vocabulary
# shards and the gather's buffer), so 12 bounds the peak.
PROMPT_LOGPROB_BYTES_PER_ENTRY = 12
# The most a chunk may allocate. Without chunks, a step's prompt of --max-num-batched-tokens
# positions held ~9 bytes x positions x vocabulary at once (7.5 GB for 8192 positions of a
# 102,400-token vocabulary), beyond the profile run's peak (which takes one row of logits), so a
# long loglikelihood request under a raised token budget could run the GPU out of memory.
PROMPT_LOGPROB_CHUNK_BYTES = 512 * 2**20


def prompt_logprob_rows(vocab_size: int) -> int:
    """Prompt positions whose logprobs are computed together (at least one)."""
    return max(1, PROMPT_LOGPROB_CHUNK_BYTES // (PROMPT_LOGPROB_BYTES_PER_ENTRY * vocab_size))


def prompt_logprobs_chunked(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            next_token_ids: torch.Tensor, num_top: int, vocab_size: int) -> DeviceLogprobs | list:
    """`prompt_logprobs_on_device(logits_of(hidden), next_token_ids, num_top)` over row chunks of
    `prompt_logprob_rows(vocab_size)` positions, so that the logits of at most one chunk exist at
    a time: hidden [M, D], next_token_ids [M] (the prompt token after each position), logits_of
    [m, D] -> [m, V]. log_softmax, rank and top-k are per row, so the rows equal the whole's up to
    the LM head GEMM's summation order for another row count."""
    step = prompt_logprob_rows(vocab_size)
    parts = [prompt_logprobs_on_device(logits_of(hidden[i:i + step]), next_token_ids[i:i + step], num_top)
             for i in range(0, hidden.shape[0], step)]
    if len(parts) == 1:
        return parts[0]
    tensors = [p._tensors for p in parts]
    return DeviceLogprobs(*(None if ts[0] is None else torch.cat(ts) for ts in zip(*tensors)))


def compute_prompt_logprobs(logits: torch.Tensor, next_token_ids: torch.Tensor,
                            num_top: int) -> list[TokenLogprobs]:
    """Logprobs of the actual next prompt tokens: logits [M, V] at prompt positions, ids [M]."""
    return list(prompt_logprobs_on_device(logits, next_token_ids, num_top))


def prompt_logprobs_on_device(logits: torch.Tensor, next_token_ids: torch.Tensor,
                              num_top: int) -> DeviceLogprobs | list:
    """compute_prompt_logprobs without reading the result back (see DeviceLogprobs)."""
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(f"prompt logprobs need logits [M, V] and next_token_ids [M], got "
                         f"{tuple(logits.shape)} and {tuple(next_token_ids.shape)}")
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return gather_logprobs(logprobs, next_token_ids.to(logits.device, torch.int64), num_top)
