"""Token sampling for a whole batch at once: the step's logit controls (``logits_processors/``:
grammar masks, allowed ids, logit bias, min_tokens, bad words, penalties), applied here and nowhere
else, then temperature, top-k / top-p / min-p, per-row seeds, and logprobs. Work over the
vocabulary is vectorized across rows; the only per-row Python is drawing the noise of rows that
carry their own seed, and the controls that some row uses."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine_svc.outputs import TokenLogprob
from engine_svc.sequence import draw_noise

# The token of a row whose controls together (grammar mask, allowed ids, bias, min_tokens' and bad
# words' bans) leave it nothing to sample: the scheduler ends that sequence with an error naming
# them instead of emitting anything.
DEAD_END_TOKEN = -1


@dataclass
class SamplingBatch:
    """Per-row parameters, as tensors on the logits' device (R rows)."""

    temperature: torch.Tensor  # [R] float; 0 means greedy
    top_k: torch.Tensor  # [R] int; 0 means off
    top_p: torch.Tensor  # [R] float
    min_p: torch.Tensor  # [R] float
    repetition_penalty: torch.Tensor  # [R] float
    presence_penalty: torch.Tensor  # [R] float
    frequency_penalty: torch.Tensor  # [R] float
    noise_keys: list[tuple[int, int] | None]  # per seeded row (sequence.noise_key); None: torch's global RNG
    num_logprobs: list[int | None]  # per row: top-N wanted (None: no logprobs)
    all_greedy: bool
    # (logits processor, its state this step) for each control some row uses, in the order applied.
    processors: list[tuple[object, object]] = field(default_factory=list)


# A row with top-p or min-p but no top-k is first ranked over its best PARTIAL_RANKS tokens only:
# that settles it whenever the last of them is already dropped, as it is for nearly every real
# distribution; the others are sorted whole (a full sort of a 49k row costs ~2.5 ms on the CPU).
PARTIAL_RANKS = 256


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p (nucleus) and min-p exclude; ``logits`` already tempered.

    Only rows with a filter on are touched; a row with top-k is ranked by ``topk`` over its k best
    (top-p and min-p then apply within them, renormalized), a row without by its best
    ``PARTIAL_RANKS`` where they settle it. Rows are grouped by their k and each row's path depends
    on its own values only, so a row's result does not depend on what else shares the batch."""
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    active = (k < vocab) | (top_p < 1) | (min_p > 0)
    if not bool(active.any()):
        return logits
    mask = torch.zeros_like(logits, dtype=torch.bool)
    groups: dict[int, list[int]] = {}
    for r, (row_k, on) in enumerate(zip(k.tolist(), active.tolist(), strict=True)):
        if on:
            groups.setdefault(row_k, []).append(r)
    for group_k, group in groups.items():
        rows = torch.tensor(group)
        sub, p, m = logits[rows], top_p[rows], min_p[rows]
        if group_k < vocab:
            ranked, order = sub.topk(group_k, dim=-1)  # descending; what it leaves out is dropped
            mask[rows] = _mask_from_ranks(order, _drops(ranked.softmax(dim=-1), p, m), vocab)
            continue
        width = min(PARTIAL_RANKS, vocab)
        ranked, order = sub.topk(width, dim=-1)
        drop = _drops((ranked - sub.logsumexp(dim=-1, keepdim=True)).exp(), p, m)
        mask[rows] = _mask_from_ranks(order, drop, vocab)
        unsettled = (~drop[:, -1]).nonzero().squeeze(1) if width < vocab else []
        if len(unsettled):  # the best `width` do not reach top_p / min_p: rank the whole row
            ranked, order = sub[unsettled].sort(dim=-1, descending=True)
            drop = _drops(ranked.softmax(dim=-1), p[unsettled], m[unsettled])
            mask[rows[unsettled]] = _mask_from_ranks(order, drop, vocab)
    return logits.masked_fill(mask, float("-inf"))


def _drops(probs: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Which of the ranked ``probs [R, n]`` (descending) top-p and min-p drop."""
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    return drop


def _mask_from_ranks(order: torch.Tensor, drop: torch.Tensor, vocab: int) -> torch.Tensor:
    """The vocabulary mask of rows ranked by ``order [R, n]``: ranked tokens as ``drop`` says, the
    rest dropped."""
    return torch.ones(order.shape[0], vocab, dtype=torch.bool, device=order.device).scatter(1, order, drop)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``logits.argmax(dim=-1)``. On the CPU numpy's: torch's walks a row in a scalar loop (110 us
    for a 49k vocabulary, measured; numpy's 2.4 us), and greedy decoding asks once a token. The
    same index either way: the first maximum, a NaN counting as the maximum
    (tests/test_sampler_argmax.py)."""
    if (
        logits.is_cpu
        and logits.dim() == 2
        and logits.dtype is torch.float32
        and logits.shape[1]
        and not logits.requires_grad
    ):
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


class Sampler:
    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample one token per row of ``logits [R, V]`` (fp32). Returns token ids and logprobs."""
        for processor, state in b.processors:  # what the request may sample at all
            if processor.constraint:
                logits = processor.apply(logits, state, b)
        raw_logprobs = _wanted_log_softmax(logits, b.num_logprobs)
        for processor, state in b.processors:  # bans and penalties, after the logprobs are read
            if not processor.constraint:
                logits = processor.apply(logits, state, b)
        dead = None
        if b.processors:  # rows that every control together leaves without a token
            dead = torch.isneginf(logits).all(dim=-1)
            if not dead.any():
                dead = None
        greedy = argmax_rows(logits)
        if b.all_greedy:
            tokens = greedy
        else:
            tokens = torch.where(b.temperature == 0, greedy, self._sample(logits, b))
        if dead is not None:
            tokens = tokens.masked_fill(dead, DEAD_END_TOKEN)
        token_list = tokens.tolist()
        return token_list, self._logprobs(raw_logprobs, token_list, b.num_logprobs)

    def _sample(self, logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
        temp = torch.where(b.temperature > 0, b.temperature, 1.0)
        logits = filter_logits(logits / temp[:, None], b.top_k, b.top_p, b.min_p)
        probs = logits.softmax(dim=-1)
        # Exponential race: argmax(p / E) with E ~ Exp(1) samples from p. Seeded rows draw their own
        # noise so that their tokens do not depend on what else shares the batch.
        noise = torch.empty_like(probs)
        unseeded = [r for r, key in enumerate(b.noise_keys) if key is None]
        if unseeded and probs.is_cpu:
            # From torch's global RNG (torch.manual_seed decides them) through numpy's generator:
            # torch's exponential_ costs 4x as much on the CPU (1.2 ms for a 49k row).
            rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,))))
            drawn = rng.standard_exponential((len(unseeded), probs.shape[1]), dtype=np.float32)
            noise[unseeded] = torch.from_numpy(drawn)
        elif unseeded:  # on the device: drawn there, nothing crosses to the host
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for r, key in enumerate(b.noise_keys):
            if key is not None:
                noise[r] = torch.from_numpy(draw_noise(key, probs.shape[1])).to(probs.device)
        # A float32 exponential can be exactly 0 (numpy's, about once per 10**7 draws): 0 / 0 would
        # make a masked-out token win the race.
        noise.clamp_(min=1e-30)
        return argmax_rows(probs / noise)

    @staticmethod
    def _logprobs(raw: tuple | None, tokens: list[int], wanted: list[int | None]):
        if raw is None:
            return [None] * len(tokens)
        lp, positions = raw  # log-softmax of the rows that want logprobs, in row order
        rows = [r for r, n in enumerate(wanted) if n is not None and tokens[r] != DEAD_END_TOKEN]
        if not rows:
            return [None] * len(tokens)
        if len(rows) != lp.shape[0]:  # a dead-end row has no token to score
            lp = lp[torch.tensor([positions[r] for r in rows], device=lp.device)]
        chosen = torch.tensor([tokens[r] for r in rows], device=lp.device)
        top_n = max(wanted[r] for r in rows)
        chosen_lp, ranks, top_lp, top_ids = _score(lp, chosen, top_n)
        out: list[TokenLogprob | None] = [None] * len(tokens)
        for i, r in enumerate(rows):
            n = wanted[r]
            out[r] = TokenLogprob(
                token_id=tokens[r],
                logprob=float(chosen_lp[i]),
                rank=int(ranks[i]),
                top_ids=top_ids[i, :n].tolist() if n else [],
                top_logprobs=top_lp[i, :n].tolist() if n else [],
            )
        return out


def _wanted_log_softmax(logits: torch.Tensor, wanted: list[int | None]) -> tuple | None:
    """``log_softmax`` of the rows that ask for logprobs only (a row's values are the same computed
    alone or among others), and each such row's position in it; None when no row asks."""
    rows = [r for r, n in enumerate(wanted) if n is not None]
    if not rows:
        return None
    if len(rows) == logits.shape[0]:
        return logits.log_softmax(dim=-1), {r: r for r in rows}
    lp = logits[torch.tensor(rows, device=logits.device)].log_softmax(dim=-1)
    return lp, {r: i for i, r in enumerate(rows)}


def _score(lp: torch.Tensor, chosen: torch.Tensor, top_n: int):
    """Per row of ``lp [R, V]``: the chosen token's logprob, its rank (1 + how many logprobs are
    strictly greater) and the ``top_n`` largest (values, ids).

    The rank is read off the top ``k = max(top_n, 1)`` where it can be: a chosen value at least the
    k-th largest has every greater value among the top k. Only the other rows (a token sampled
    outside the top k) count over the whole vocabulary, which costs a pass over ``V`` a row."""
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
    k = max(top_n, 1)
    top_lp, top_ids = lp.topk(k, dim=-1)
    inside = chosen_lp >= top_lp[:, k - 1]
    ranks = (top_lp > chosen_lp[:, None]).sum(dim=-1) + 1
    if not bool(inside.all()):
        outside = (~inside).nonzero().squeeze(1)
        ranks[outside] = (lp[outside] > chosen_lp[outside, None]).sum(dim=-1) + 1
    return chosen_lp, ranks, top_lp, top_ids


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprob of each prompt token given the ones before it: row i of ``logits`` predicts ``next_ids[i]``."""
    lp = logits.log_softmax(dim=-1)
    chosen = torch.tensor(next_ids, device=lp.device)
    chosen_lp, ranks, top_lp, top_ids = _score(lp, chosen, top_n)
    return [
        TokenLogprob(
            token_id=next_ids[i],
            logprob=float(chosen_lp[i]),
            rank=int(ranks[i]),
            top_ids=top_ids[i].tolist() if top_n else [],
            top_logprobs=top_lp[i].tolist() if top_n else [],
        )
        for i in range(len(next_ids))
    ]
