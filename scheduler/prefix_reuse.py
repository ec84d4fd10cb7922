"""Which cached blocks a waiting request takes, and whether it waits a step for blocks in progress.

A waiting request takes its longest cached prefix (`BlockManager.find_cached_prefix`); one that
still owes its prompt logprobs takes only blocks that keep theirs, one block less, with those
logprobs (`find_logprob_prefix`, scheduler/logprob_records.py).

Blocks that this step, or the step in flight under async scheduling, computes are not cached
yet. A prompt whose next MIN_SHARED_TOKENS or more tokens past its hit are such blocks (the
choices of an n > 1 request, prompts with one preamble, sent together) waits for them to be cached
rather than compute them again. One that owes its prompt logprobs with k alternatives waits only
for blocks that a prompt-logprob request with at least k computes: only those will keep logprobs
it can take.
"""

from __future__ import annotations

from scheduler.block_manager import BlockManager
from scheduler.request import Request


NO_LOGPROBS = -1  # `computing`'s value for a block that no prompt-logprob request computes


class PrefixReuse:
    MIN_SHARED_TOKENS = 64  # prompt tokens that another request is computing, worth a step's wait

    def __init__(self, block_manager: BlockManager, enabled: bool) -> None:
        self.block_manager, self.enabled = block_manager, enabled
        # the prompt blocks the last schedule() computes -> the most alternatives a prompt-logprob
        # request computing it wants (NO_LOGPROBS: none does)
        self.prev: dict[bytes, int] = {}

    def hit(self, request: Request) -> tuple[list[int], list]:
        """(cached block ids, prompt logprobs of their tokens, if it owes them) for a waiting request."""
        if request.wants_prompt_logprobs:
            return self.block_manager.find_logprob_prefix(request, request.sampling_params.prompt_logprobs)
        return self.block_manager.find_cached_prefix(request), []

    def mark(self, computing: dict[bytes, int], request: Request, start: int, n: int) -> None:
        """Add the prompt blocks a chunk of `n` tokens from `start` completes (none for a decode)."""
        if n > 1 and self.enabled:
            tpb = self.block_manager.tokens_per_block
            k = request.sampling_params.prompt_logprobs if request.wants_prompt_logprobs else NO_LOGPROBS
            for h in request.block_hashes[start // tpb:(start + n) // tpb]:
                computing[h] = max(computing.get(h, NO_LOGPROBS), k)

    def waits(self, request: Request, num_hit_blocks: int, computing: dict[bytes, int]) -> bool:
        """Whether the request waits a step: its next MIN_SHARED_TOKENS+ tokens past its hit are all
        blocks `computing` (this step) or the last step computes, by a prompt-logprob request
        wanting at least as many alternatives where it owes its prompt logprobs."""
        if not (computing or self.prev):
            return False
        hashes, tpb = request.block_hashes, self.block_manager.tokens_per_block
        need = -(-self.MIN_SHARED_TOKENS // tpb)
        ahead = hashes[num_hit_blocks:min(num_hit_blocks + need, (request.num_tokens - 1) // tpb)]
        if request.wants_prompt_logprobs:
            k = request.sampling_params.prompt_logprobs
            most = (max(computing.get(h, NO_LOGPROBS), self.prev.get(h, NO_LOGPROBS)) for h in ahead)
            return len(ahead) == need and all(m >= k for m in most)
        return len(ahead) == need and all(h in computing or h in self.prev for h in ahead)
