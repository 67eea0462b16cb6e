"""What a step costs, in token-equivalents: the scheduler's work budget.

A token's forward pass does the same linear work at any depth (the projections and the MLP), and
attention work in proportion to the context it attends to. With ``ratio`` the attention work per
context token relative to a token's linear work (``attention_work_ratio``), a token at position
``c`` (attending to ``c + 1`` tokens) costs ``1 + ratio * (c + 1)`` token-equivalents. Both
constants come from the model's config (FLOPs, not measured timings), so a step's plan stays a
function of the queue alone: deterministic, and the same on every machine.

The step's work budget is what a chunk of ``max_num_batched_tokens`` tokens costs at depth 0, so
short prompts are scheduled exactly as by a token budget; deeper in a long prompt a chunk gets
fewer tokens, and a step's work (its duration, and the stall it puts on every other stream's next
token) stays about the same at any depth.

While sequences decode, that budget is still a long stall for them: a decode step is mostly the
step's fixed cost (reading the weights once), a few token-equivalents of work, and a full prompt
chunk is a thousand times more. ``decode_cap`` bounds such a step at ``factor`` times the decode
step alone, counting the fixed cost as ``floor`` token-equivalents: the tokens whose compute takes
as long as one read of the weights. That balance is the machine's and the weights' (int8 GEMMs on a
2-core AVX2 CPU: Qwen2.5-Coder-0.5B Q4_K_M decodes a token in ~21 ms and prefills ~212 tokens/s, a
floor of ~4.5; on an AVX-512 VNNI CPU SmolLM2-135M's was ~14), so it is measured while serving
(``FloorFit``: step times against their planned work), starting from ``STEP_FLOOR``.
"""

from __future__ import annotations

import math


def attention_work_ratio(
    hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, intermediate: int
) -> float:
    """Attention multiply-adds per context token over linear multiply-adds per token, per layer:
    q.k and p.v are ``2 * heads * head_dim`` per context token; the linears are the QKV, O,
    gate/up and down projections. (The LM head runs for sampled rows only: left out.)"""
    q_width = num_heads * head_dim
    linear = hidden * (q_width + 2 * num_kv_heads * head_dim) + q_width * hidden + 3 * hidden * intermediate
    return 2 * q_width / linear


def ratio_for_spec(spec) -> float:
    """``attention_work_ratio`` of a ``ModelSpec``."""
    return attention_work_ratio(
        spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.intermediate_size
    )


class StepCost:
    """The cost rule and the budget it implies for ``max_num_batched_tokens``; ``ratio`` 0 counts
    tokens alone (the budget is then the token budget)."""

    def __init__(self, max_num_batched_tokens: int, ratio: float) -> None:
        if not (ratio >= 0 and math.isfinite(ratio)):
            raise ValueError(f"attention_work_ratio must be a finite number >= 0, got {ratio!r}")
        self.ratio = ratio
        self.budget = self.chunk(0, max_num_batched_tokens)

    def chunk(self, start: int, n: int) -> float:
        """Work of computing positions ``start .. start + n - 1`` of one sequence."""
        return n + self.ratio * (n * start + n * (n + 1) / 2)

    def max_tokens(self, start: int, work: float, limit: int) -> int:
        """The most tokens (at most ``limit``) from position ``start`` whose chunk costs at most
        ``work``: 0 when not even one fits."""
        if limit <= 0 or work <= 0:
            return 0
        if self.chunk(start, limit) <= work:
            return limit
        a = self.ratio
        if a == 0:
            return min(limit, int(work))
        # n + a*(n*start + n(n+1)/2) <= work: the positive root of a/2 n^2 + (1 + a(start + 1/2)) n - work
        b = 1 + a * (start + 0.5)
        n = int((-b + math.sqrt(b * b + 2 * a * work)) / a)
        n = max(0, min(n, limit))
        while n > 0 and self.chunk(start, n) > work:  # the float root may land one above
            n -= 1
        while n < limit and self.chunk(start, n + 1) <= work:
            n += 1
        return n


# A step's fixed cost in token-equivalents (see the module's docstring), per device type.
STEP_FLOOR = {"cpu": 16.0, "cuda": 256.0}
# The default factor per device type (absent: off). CPU: 3 (Qwen2.5-Coder-0.5B, a stream beside a
# 6,000-token prompt: p99 inter-token latency 2.5x its latency alone, against 53-198x without; the
# prompt's first token 1.4x later). On CUDA a step's fixed cost dwarfs a chunk's: not measured, off.
DECODE_STALL_FACTOR: dict[str, float] = {"cpu": 3.0}


class FloorFit:
    """A step's fixed cost in token-equivalents, measured: the line through the mean (planned work,
    seconds) of recent decode steps and that of recent steps with prompt chunks (exponentially
    weighted, ``decay`` per step of the kind) gives the seconds of a step of no work (the weights'
    read) over the seconds of one token-equivalent. Until it has seen both kinds, or where the line
    is not a cost (a negative part), ``floor()`` returns the default. Only the cap beside decodes
    reads it: a prompt's chunks alone keep the budget, so nothing but latency depends on timings."""

    def __init__(self, decay: float = 0.1, min_steps: int = 3) -> None:
        self.decay, self.min_steps = decay, min_steps
        self._means: dict[bool, list[float]] = {}  # with chunks? -> [steps, work, seconds]

    def observe(self, work: float, seconds: float, chunks: bool) -> None:
        m = self._means.get(chunks)
        if m is None:
            m = self._means[chunks] = [0, work, seconds]
        m[0] += 1
        m[1] += self.decay * (work - m[1])
        m[2] += self.decay * (seconds - m[2])

    def floor(self, default: float) -> float:
        d, c = self._means.get(False), self._means.get(True)
        if d is None or c is None or min(d[0], c[0]) < self.min_steps or c[1] - d[1] < 1.0:
            return default
        slope = (c[2] - d[2]) / (c[1] - d[1])
        fixed = d[2] - slope * d[1]
        if slope <= 0 or fixed <= 0:
            return default
        return min(max(fixed / slope, 1.0), 1024.0)


def decode_cap(decode_work: float, factor: float, floor: float) -> float:
    """The most work a step with prompt chunks may take beside decodes of ``decode_work``: so
    that ``floor + its work <= factor * (floor + decode_work)``."""
    return factor * (floor + decode_work) - floor
