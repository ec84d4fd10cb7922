"""Token sampling: penalties, temperature, top-k / top-p / min-p, per-request seeded draws, and the
logprobs of what was sampled (gathered by engine/logprobs.py).

Order per step (vLLM semantics): structured-output token bitmask -> min_tokens and bad_words
masking -> allowed_token_ids -> logit_bias -> repetition / frequency / presence penalties ->
(greedy rows: argmax here) -> temperature -> min-p -> top-k -> top-p -> sample.
Reported logprobs are taken from the RAW logits (log_softmax of what the model produced, after
the grammar's mask, which vLLM applies before its sampler), as vLLM and OpenAI report them, not
from the processed distribution that was sampled.

Seeded rows draw an Exponential(1) noise vector from their own generator and take
argmax(probs / q) (the "exponential race", equivalent to sampling from probs). The row's noise
never depends on other rows, so a seed gives the same stream whatever the batch looks like.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from common.sampling_params import FP32_OVERFLOW, GREEDY_TEMPERATURE_EPS, SamplingParams, bad_word_bans
from common.transfer import to_device
from engine.logprobs import DeviceLogprobs, gather_logprobs

_NEG_INF = float("-inf")


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on `device` seeded with `seed`, to be kept per request for its whole life."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def check_sampling_params(p: SamplingParams) -> None:
    """ValueError naming the field when torch cannot build this request's sampling state (its
    generator, its int64 / fp32 columns). The engine core runs it when a request is added, so
    that a bad value is refused on its own instead of failing a whole step later. The int64 and
    fp32 tests are done in Python (the ranges torch.tensor accepts), not by building tensors:
    this runs for every request on the core's loop."""
    if p.seed is not None:
        try:
            torch.Generator().manual_seed(p.seed)
        except (RuntimeError, OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"seed {p.seed!r} cannot seed a torch generator ({e})") from None
    for name, values in (("top_k", [p.top_k]), ("stop_token_ids", list(p.stop_token_ids))):
        bad = next((v for v in values if not isinstance(v, int) or not _INT64_MIN <= v <= _INT64_MAX), None)
        if bad is not None:
            raise ValueError(f"{name} {values!r} does not fit in int64 ({bad!r} is not an int64)")
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        v = getattr(p, name)
        if not (math.isfinite(float(v)) and abs(float(v)) < FP32_OVERFLOW):
            raise ValueError(f"{name} {v!r} is not a finite fp32 number")


@dataclass
class SamplingBatch:
    """Per-row sampling state for the N rows that sample this step (built by the model runner)."""

    temperature: torch.Tensor  # [N] fp32, 0 = greedy
    all_greedy: bool
    top_p: torch.Tensor | None = None  # [N] fp32; None when no row uses it
    top_k: torch.Tensor | None = None  # [N] int64, 0 = off; None when no row uses it
    # host-side max of top_k when every sampled row sets one: then top-k + top-p work on
    # topk(max_top_k) candidates instead of sorting the whole vocabulary; None: full sort
    max_top_k: int | None = None
    min_p: torch.Tensor | None = None  # [N] fp32; None when no row uses it
    generators: Sequence[torch.Generator | None] = ()  # [N] or empty (no seeded rows)
    presence_penalty: torch.Tensor | None = None  # [N]
    frequency_penalty: torch.Tensor | None = None  # [N]
    repetition_penalty: torch.Tensor | None = None  # [N]
    prompt_token_ids: list[list[int]] | None = None  # [N][*], needed for repetition_penalty
    output_token_ids: list[list[int]] | None = None  # [N][*], needed for any penalty
    max_num_logprobs: int | None = None  # max over rows of params.logprobs; None: nobody wants them
    # [N][*] token ids to forbid (eos / stop ids of rows still below min_tokens, the bad words'
    # next tokens); None: none
    min_tokens_masked_ids: list[list[int]] | None = None
    # structured outputs: allowed-token bitmasks [G, ceil(V / 32)] int32 of the constrained rows
    # `bitmask_rows` [G] int64 (bit t % 32 of word t // 32: token t); None: no row constrained
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: torch.Tensor | None = None
    # sparse logit_bias of the rows that have one: (rows [B] int64, token ids [B] int64,
    # biases [B] fp32); None when no row has a bias
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # allowed_token_ids of the rows that have them: (rows [R] int64, (row of R, token id) pairs as
    # two [A] int64 columns); None when no row has them
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def unmodified(self) -> bool:
        """Whether no row's logits are changed before sampling (no min_tokens mask, logit bias,
        penalty or token bitmask)."""
        return (not (self.min_tokens_masked_ids and any(self.min_tokens_masked_ids)) and self.logit_bias is None
                and self.allowed is None
                and self.presence_penalty is None and self.frequency_penalty is None
                and self.repetition_penalty is None and self.token_bitmask is None)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[list[int]],
        output_token_ids: Sequence[list[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: Sequence[int],
        device: torch.device | str,
    ) -> SamplingBatch:
        """Build a batch from per-row params and token histories (host work, one copy per field)."""
        n = len(params)
        if not (len(prompt_token_ids) == len(output_token_ids) == len(generators) == n):
            raise ValueError(
                f"from_params needs one prompt, output and generator per row: got {n} params, "
                f"{len(prompt_token_ids)} prompts, {len(output_token_ids)} outputs, "
                f"{len(generators)} generators")

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(values, dtype, device)

        temperature = column([p.temperature for p in params], torch.float32)
        all_greedy = all(p.greedy for p in params)
        sampled = [p for p in params if not p.greedy]
        top_p = top_k = min_p = max_top_k = None
        if any(p.top_p < 1.0 for p in sampled):
            top_p = column([p.top_p for p in params], torch.float32)
        if any(p.top_k > 0 for p in sampled):
            # greedy rows take the argmax whatever their top_k: 1 keeps the candidate set small
            top_k = column([1 if p.greedy else p.top_k for p in params], torch.int64)
            if all(p.top_k > 0 for p in sampled):
                max_top_k = max(p.top_k for p in sampled)
        if any(p.min_p > 0.0 for p in sampled):
            min_p = column([p.min_p for p in params], torch.float32)

        presence = frequency = repetition = None
        prompts = outputs = None
        if any(p.needs_penalties for p in params):
            presence = column([p.presence_penalty for p in params], torch.float32)
            frequency = column([p.frequency_penalty for p in params], torch.float32)
            repetition = column([p.repetition_penalty for p in params], torch.float32)
            outputs = [list(o) for o in output_token_ids]
            if any(p.repetition_penalty != 1.0 for p in params):
                prompts = [list(t) for t in prompt_token_ids]

        # the rows' token masks and biases, in one walk over the rows: the min_tokens and bad-word
        # bans (ids per row), allowed_token_ids (row of the allowed rows, token id) pairs, and
        # logit_bias (row, token id, bias) entries
        masked = None
        allowed_rows, allowed_which, allowed_ids = [], [], []
        bias_rows, bias_ids, biases = [], [], []
        for i, (p, out) in enumerate(zip(params, output_token_ids)):
            banned = []
            if len(out) < p.min_tokens:
                # EOS too under ignore_eos, as vLLM's min_tokens masks it: no EOS text before then
                banned = list(p.stop_token_ids) + list(eos_token_ids)
            if p.bad_words_token_ids:
                banned += bad_word_bans(p.bad_words_token_ids, out)
            if banned:
                masked = masked or [[] for _ in range(n)]
                masked[i] = banned
            if p.allowed_token_ids is not None:
                allowed_which.extend([len(allowed_rows)] * len(p.allowed_token_ids))
                allowed_ids.extend(p.allowed_token_ids)
                allowed_rows.append(i)
            if p.logit_bias:
                bias_rows.extend([i] * len(p.logit_bias))
                bias_ids.extend(p.logit_bias)
                biases.extend(p.logit_bias.values())
        allowed = logit_bias = None
        if allowed_rows:
            allowed = (column(allowed_rows, torch.int64), column(allowed_which, torch.int64),
                       column(allowed_ids, torch.int64))
        if bias_rows:
            logit_bias = (column(bias_rows, torch.int64), column(bias_ids, torch.int64),
                          column(biases, torch.float32))

        wanted = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            logit_bias=logit_bias,
            allowed=allowed,
            temperature=temperature,
            all_greedy=all_greedy,
            top_p=top_p,
            top_k=top_k,
            max_top_k=max_top_k,
            min_p=min_p,
            generators=list(generators) if any(g is not None for g in generators) else (),
            presence_penalty=presence,
            frequency_penalty=frequency,
            repetition_penalty=repetition,
            prompt_token_ids=prompts,
            output_token_ids=outputs,
            max_num_logprobs=max(wanted) if wanted else None,
            min_tokens_masked_ids=masked,
        )


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor  # [N] int64
    # per row when max_num_logprobs is not None: the sampled token under the raw distribution, its
    # rank and the top max_num_logprobs alternatives (the runner trims to each row's own count);
    # a lazy sequence: reading it waits for the GPU
    logprobs: DeviceLogprobs | None


class Sampler:
    """Turns logits [N, V] (the LM head's dtype, or fp32) into one token per row, following each
    row's sampling params; the processing runs in fp32. A batch of greedy rows that nothing
    modifies (no min_tokens mask, logit bias, penalty or grammar) takes the argmax of the logits
    as they come: converting bf16 / fp16 to fp32 is exact, so the maximum and its first index are
    the same, and the step saves the fp32 copy (at V2-Lite's 102,400-token vocabulary, 128 rows:
    ~79 MB written and read again). `argmax`: the greedy rows' argmax over `[N, V]` (the plan's
    `argmax`: torch's, or common/triton_argmax.py; both take any float dtype)."""

    def __init__(self, argmax=None):
        self.argmax = argmax or _torch_argmax

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.temperature.shape[0]:
            raise ValueError(f"logits must be [N, V] with N = {batch.temperature.shape[0]} rows, "
                             f"got {tuple(logits.shape)}")
        if batch.token_bitmask is not None:
            # the grammar's mask comes first, as vLLM applies it to the logits before its sampler:
            # the reported logprobs are over the tokens the grammar allows
            logits = _apply_token_bitmask(logits.float(), batch.token_bitmask, batch.bitmask_rows)
        if batch.all_greedy and batch.unmodified:
            token_ids = self.argmax(logits)
        else:
            token_ids = self._choose(logits.float(), batch)
        logprobs = None
        if batch.max_num_logprobs is not None:  # of the raw distribution, whatever else modified the choice
            logprobs = gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids,
                                        batch.max_num_logprobs)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)

    def _choose(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Each row's token from fp32 logits, after the rows' modifiers."""
        logits = _mask_min_tokens(logits, batch.min_tokens_masked_ids)
        logits = _apply_allowed(logits, batch.allowed)
        logits = _apply_logit_bias(logits, batch.logit_bias)
        logits = _apply_penalties(logits, batch)
        greedy_ids = self.argmax(logits)
        if batch.all_greedy:
            return greedy_ids
        return torch.where(batch.temperature == 0.0, greedy_ids, self._sample(logits, batch))

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        # greedy rows divide by 1 here; their result is replaced by the argmax afterwards
        temp = torch.where(batch.temperature == 0.0, 1.0, batch.temperature)
        logits = logits / temp.unsqueeze(1)
        # vLLM's order: min_p on the tempered distribution, then top-k and top-p on what is left
        if batch.min_p is not None:
            logits = _apply_min_p(logits, batch.min_p)
        logits = _apply_top_k_top_p(logits, batch.top_k, batch.top_p, batch.max_top_k)
        probs = torch.softmax(logits, dim=-1)
        return _exponential_race(probs, batch.generators)


def _torch_argmax(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(dim=-1)


def _mask_min_tokens(logits: torch.Tensor, masked_ids: list[list[int]] | None) -> torch.Tensor:
    if not masked_ids or not any(masked_ids):
        return logits
    rows = [i for i, ids in enumerate(masked_ids) for _ in ids]
    cols = [t for ids in masked_ids for t in ids]
    logits = logits.clone()
    logits[to_device(rows, torch.int64, logits.device), to_device(cols, torch.int64, logits.device)] = _NEG_INF
    return logits


def _apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None,
                         rows: torch.Tensor | None) -> torch.Tensor:
    """-inf for the tokens a row's grammar forbids; rows without a grammar are untouched."""
    if bitmask is None:
        return logits
    vocab = logits.shape[1]
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().flatten(1)[:, :vocab]  # [G, V]
    if allowed.shape[1] < vocab:  # a bitmask narrower than the logits forbids the rest
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]), value=False)
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~allowed, _NEG_INF)
    return logits


def _apply_allowed(logits: torch.Tensor,
                   allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """-inf for every token a row with allowed_token_ids does not list; other rows untouched."""
    if allowed is None:
        return logits
    rows, which, ids = allowed
    keep = torch.zeros(rows.shape[0], logits.shape[1], dtype=torch.bool, device=logits.device)
    keep[which, ids] = True
    logits = logits.clone()
    logits[rows] = logits[rows].masked_fill(~keep, _NEG_INF)
    return logits


def _apply_logit_bias(logits: torch.Tensor,
                      bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    # out of place: `logits` may still be the raw logits that logprobs are reported from
    if bias is None:
        return logits
    rows, ids, values = bias
    return logits.index_put((rows, ids), values, accumulate=True)


def _token_counts(token_ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[N, V] fp32 occurrence counts of each token id per row."""
    lengths = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=len(token_ids))
    total = int(lengths.sum())
    counts = torch.zeros(len(token_ids) * vocab, dtype=torch.float32, device=device)
    if total:
        # one flat host array and one copy: row * V + token for every occurrence
        flat = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total)
        flat += np.repeat(np.arange(len(token_ids), dtype=np.int64) * vocab, lengths)
        index = torch.from_numpy(flat).to(device, non_blocking=True)
        counts.index_add_(0, index, torch.ones(total, dtype=torch.float32, device=device))
    return counts.view(len(token_ids), vocab)


def _apply_penalties(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    rep, freq, pres = batch.repetition_penalty, batch.frequency_penalty, batch.presence_penalty
    if rep is None and freq is None and pres is None:
        return logits
    if batch.output_token_ids is None:
        raise ValueError("output_token_ids must be set when a penalty tensor is given")
    n, vocab = logits.shape
    out_counts = _token_counts(batch.output_token_ids, vocab, logits.device)  # [N, V]
    if rep is not None:
        # vLLM/CTRL semantics: every token seen in prompt or output is pushed towards "less likely"
        seen = out_counts > 0
        if batch.prompt_token_ids is not None:
            seen = seen | (_token_counts(batch.prompt_token_ids, vocab, logits.device) > 0)
        pen = rep.unsqueeze(1)
        # clamped: a penalty near 0 (or a huge one) would push a logit to +-inf and the row's
        # softmax to NaN. The bound survives the smallest sampling temperature's divide; a -inf
        # already there (a banned token) stays -inf.
        big = torch.finfo(logits.dtype).max * GREEDY_TEMPERATURE_EPS
        scaled = torch.where(logits > 0, logits / pen, logits * pen).clamp(-big, big)
        scaled = torch.where(logits.isinf(), logits, scaled)
        logits = torch.where(seen, scaled, logits)
    if freq is not None:
        logits = logits - freq.unsqueeze(1) * out_counts
    if pres is not None:
        logits = logits - pres.unsqueeze(1) * (out_counts > 0).float()
    return logits


def _apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, max_top_k: int | None) -> torch.Tensor:
    if top_k is None and top_p is None:
        return logits
    vocab = logits.shape[1]
    narrow = top_k is not None and max_top_k is not None and max_top_k < vocab
    if narrow:
        # every row keeps at most max_top_k tokens (and their ties): only those need ordering
        sorted_logits, order = logits.topk(max_top_k, dim=-1)  # [N, K] each, descending
    else:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # [N, V] each
    width = sorted_logits.shape[1]
    if top_k is not None:
        # vLLM's rule: a token survives when its logit reaches the row's k-th largest, so every
        # token tied with the k-th survives (bf16 logits tie often)
        k = torch.where(top_k <= 0, width, top_k).clamp(max=width)  # [N]
        kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))  # [N, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        probs = torch.softmax(sorted_logits, dim=-1)
        # keep the smallest prefix whose mass reaches top_p: drop a token when the mass strictly
        # before it already does; the first token always survives (mass before it is 0 < top_p)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        drop[:, 0] = False  # also when top_p rounds to 0 in fp32 (a request's 1e-46 is > 0)
        sorted_logits = sorted_logits.masked_fill(drop, _NEG_INF)
    kept = torch.full_like(logits, _NEG_INF).scatter_(1, order, sorted_logits)
    if narrow:
        # ties of the k-th value past the max_top_k candidates survive too, where top-p kept the
        # k-th (top-p's mass was taken over the candidates alone)
        kth_kept = sorted_logits.gather(1, (k - 1).unsqueeze(1)) > _NEG_INF  # [N, 1]
        kept = torch.where((logits == kth) & kth_kept, logits, kept)
    return kept


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    # p_i < min_p * p_max  <=>  logit_i < logit_max + log(min_p); a min_p of 0 gives -inf: no-op
    threshold = logits.max(dim=-1, keepdim=True).values + torch.log(min_p).unsqueeze(1)
    return logits.masked_fill(logits < threshold, _NEG_INF)


def _exponential_race(probs: torch.Tensor,
                      generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Sample one token per row: argmax(probs / q), q ~ Exponential(1) i.i.d. per token."""
    seeded = [(i, g) for i, g in enumerate(generators) if g is not None]
    q = torch.empty_like(probs)
    if len(seeded) < probs.shape[0]:
        q.exponential_()  # unseeded rows: global RNG (seeded rows are overwritten below)
    for i, gen in seeded:
        q[i].exponential_(generator=gen)
    # q == 0 has probability ~0 but would give 0/0 = nan for a filtered-out token
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)
