"""Logprobs on the device: the sampled tokens' (the Sampler's) and the prompt's (prompt_logprobs).

Both are taken from the raw logits' log_softmax and kept as tensors (DeviceLogprobs) until the
step has finished, so reading them never stalls the GPU's queue.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from common.transfer import to_host
from scheduler.outputs import TokenLogprobs


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

    def __getitem__(self, i):
        return self._materialize()[i]


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> DeviceLogprobs:
    """Logprob, rank (1 = most likely) and top-`num_top` of each row's chosen token."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1  # [N]
    num_top = min(num_top, logprobs.shape[1])
    top_vals, top_ids = logprobs.topk(num_top, dim=-1) if num_top > 0 else (None, None)
    return DeviceLogprobs(token_ids, chosen, ranks, top_vals, top_ids)


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
