"""Token sampling for a whole batch at once: structured-output masks, allowed ids and logit bias,
penalties, temperature, top-k / top-p / min-p, per-row seeds, and logprobs. Work over the
vocabulary is vectorized across rows; the only per-row Python is drawing the noise of rows that
carry their own seed, and the per-row options that some row uses."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine_svc.outputs import TokenLogprob
from engine_svc.sequence import draw_noise

# The token of a row whose constraints (grammar mask, allowed ids, bias) leave it nothing to sample:
# the scheduler ends that sequence instead of emitting anything.
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
    output_ids: list[list[int]]  # per row, for penalties
    prompt_ids: list[list[int]]  # per row, for the repetition penalty
    banned_ids: list[list[int]]  # per row: ids that may not be sampled now (EOS before min_tokens)
    num_logprobs: list[int | None]  # per row: top-N wanted (None: no logprobs)
    any_penalty: bool
    all_greedy: bool
    logit_bias: list[dict[int, float] | None] | None = None  # per row, when some row has one
    allowed_ids: list[list[int] | None] | None = None  # per row, when some row has them
    matchers: list | None = None  # per row: its llguidance matcher (structured output) or None
    # First row of a constrained sequence verifying drafts -> its drafts: rows r + 1 .. r + k get
    # the masks of the states after drafts[:1] .. drafts[:k].
    grammar_drafts: dict[int, list[int]] | None = None
    grammar_executor: object = None  # llguidance.LLExecutor: fills the rows' masks in parallel


def apply_constraints(logits: torch.Tensor, b: SamplingBatch) -> None:
    """In place: a grammar's token mask, allowed token ids and logit bias, row by row as asked.
    Logprobs are reported after these (what the request could have sampled), as vLLM does."""
    if b.matchers is not None:
        apply_grammar_masks(logits, b.matchers, b.grammar_executor, b.grammar_drafts)
    if b.allowed_ids is not None:
        rows = [r for r, ids in enumerate(b.allowed_ids) if ids is not None]
        keep = torch.full(
            (len(rows), logits.shape[1]), float("-inf"), dtype=logits.dtype, device=logits.device
        )
        for i, r in enumerate(rows):
            keep[i, torch.tensor(b.allowed_ids[r], device=logits.device)] = 0.0
        logits[rows] += keep
    if b.logit_bias is not None:
        for r, bias in enumerate(b.logit_bias):
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                logits[r, ids] += torch.tensor(list(bias.values()), dtype=logits.dtype, device=logits.device)


def apply_grammar_masks(
    logits: torch.Tensor, matchers: list, executor, drafts: dict[int, list[int]] | None = None
) -> None:
    """Each constrained row keeps only the tokens its grammar allows next. The masks of all rows
    are filled in parallel calls; rows sharing a matcher (an n > 1 prompt about to fork) are
    filled once and copied. A sequence verifying drafts has a row per position: llguidance
    advances its matcher through the drafts, fills each position's mask, and rolls it back (a
    draft the grammar refuses stops the walk there: the rows after it stay unmasked, and are never
    used, since the target cannot sample a refused draft and verification stops at it)."""
    import llguidance.torch as lt

    drafts = drafts or {}
    rows = [r for r, m in enumerate(matchers) if m is not None]
    covered = {r + 1 + j for r, d in drafts.items() for j in range(len(d))}  # filled with their first row
    first: dict[int, int] = {}  # id(matcher) -> its row in the mask
    for i, r in enumerate(rows):
        if r not in covered:
            first.setdefault(id(matchers[r]), i)
    mask = lt.allocate_token_bitmask(len(rows), logits.shape[1])
    plain = [(matchers[rows[i]], i) for i in first.values() if rows[i] not in drafts]
    if plain:
        lt.fill_next_token_bitmask_par(executor, plain, mask)
    drafting = [(matchers[rows[i]], i, drafts[rows[i]]) for i in first.values() if rows[i] in drafts]
    if drafting:
        lt.fill_next_token_bitmask_par_with_draft_tokens(executor, drafting, mask)
    for i, r in enumerate(rows):
        if r in covered:
            continue
        j = first[id(matchers[r])]
        if j != i:
            mask[i] = mask[j]
    bits = (mask.to(logits.device).unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1  # [rows, words, 32]
    allowed = bits.view(len(rows), -1)[:, : logits.shape[1]].bool()
    logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)  # token 32*w + b is allowed when bit b of word w is set


def apply_penalties(logits: torch.Tensor, b: SamplingBatch) -> torch.Tensor:
    """Repetition (prompt and output tokens), presence and frequency (output tokens), as vLLM/HF do."""
    rows, vocab = logits.shape
    out_counts = torch.zeros(rows, vocab, dtype=logits.dtype, device=logits.device)
    seen = torch.zeros(rows, vocab, dtype=torch.bool, device=logits.device)
    for r in range(rows):
        if b.output_ids[r]:
            ids = torch.tensor(b.output_ids[r], device=logits.device)
            out_counts[r].index_add_(0, ids, torch.ones(len(ids), dtype=logits.dtype, device=logits.device))
        if b.prompt_ids[r]:
            seen[r, torch.tensor(b.prompt_ids[r], device=logits.device)] = True
    seen |= out_counts > 0
    rep = b.repetition_penalty[:, None]
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - b.frequency_penalty[:, None] * out_counts
    logits = logits - b.presence_penalty[:, None] * (out_counts > 0).to(logits.dtype)
    return logits


def filter_logits(
    logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Mask (to -inf) what top-k, top-p (nucleus) and min-p exclude; ``logits`` already tempered."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    drop = ranks >= k[:, None]
    probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before it already does.
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= top_p[:, None]
    drop |= probs < min_p[:, None] * probs[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    mask = torch.zeros_like(drop).scatter(1, order, drop)
    return logits.masked_fill(mask, float("-inf"))


class Sampler:
    def __call__(self, logits: torch.Tensor, b: SamplingBatch) -> tuple[list[int], list[TokenLogprob | None]]:
        """Sample one token per row of ``logits [R, V]`` (fp32). Returns token ids and logprobs."""
        dead = None
        if b.matchers is not None or b.allowed_ids is not None or b.logit_bias is not None:
            apply_constraints(logits, b)
            dead = torch.isneginf(logits).all(dim=-1)  # rows whose constraints leave no token
            if not dead.any():
                dead = None
        raw_logprobs = logits.log_softmax(dim=-1) if any(n is not None for n in b.num_logprobs) else None
        for r, banned in enumerate(b.banned_ids):
            if banned:
                logits[r, banned] = float("-inf")
        if b.any_penalty:
            logits = apply_penalties(logits, b)
        greedy = logits.argmax(dim=-1)
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
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for r, key in enumerate(b.noise_keys):
            if key is not None:
                noise[r] = torch.from_numpy(draw_noise(key, probs.shape[1])).to(probs.device)
        # A float32 exponential can be exactly 0 (numpy's, about once per 10**7 draws): 0 / 0 would
        # make a masked-out token win the race.
        noise.clamp_(min=1e-30)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, tokens: list[int], wanted: list[int | None]):
        if raw is None:
            return [None] * len(tokens)
        rows = [r for r, n in enumerate(wanted) if n is not None and tokens[r] != DEAD_END_TOKEN]
        if not rows:
            return [None] * len(tokens)
        idx = torch.tensor(rows, device=raw.device)
        chosen = torch.tensor([tokens[r] for r in rows], device=raw.device)
        sub = raw[idx]
        chosen_lp = sub.gather(1, chosen[:, None]).squeeze(1)
        ranks = (sub > chosen_lp[:, None]).sum(dim=-1) + 1
        top_n = max(wanted[r] for r in rows)
        top_lp, top_ids = sub.topk(top_n, dim=-1) if top_n > 0 else (None, None)
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


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], top_n: int) -> list[TokenLogprob]:
    """Logprob of each prompt token given the ones before it: row i of ``logits`` predicts ``next_ids[i]``."""
    lp = logits.log_softmax(dim=-1)
    chosen = torch.tensor(next_ids, device=lp.device)
    chosen_lp = lp.gather(1, chosen[:, None]).squeeze(1)
    ranks = (lp > chosen_lp[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(top_n, dim=-1) if top_n else (None, None)
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
