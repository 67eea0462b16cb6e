"""What a caller may ask of one request's sampling and stopping, validated before it is admitted."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine_svc.request_limits import RequestLimits, Violation, raise_if_any, token_id_violations
from engine_svc.structured_outputs import StructuredOutputsParams

# Sampling below this temperature is greedy (a zero temperature cannot divide logits).
GREEDY_EPS = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values
MAX_LOGIT_CONTROL_IDS = 4096  # entries in logit_bias, allowed_token_ids, or bad-word tokens, each


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context
    min_tokens: int = 0
    stop: list[str] | str | None = None  # matched on text, outside the engine core
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0: the sampled token only)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # Logit controls, applied before sampling (and before logprobs are reported).
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    # Token sequences never to complete: the last token of each is banned whenever the output ends
    # with the ones before it (a one-token sequence: always). The text side tokenizes ``bad_words``.
    bad_words_token_ids: list[list[int]] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # False: this request never drafts (speculative decoding); True: as the engine is configured.
    # The tokens are the same either way, only the speed differs.
    speculative: bool = True
    # An embedding request: "last" (the last prompt token's) or "mean" (all prompt tokens') final
    # hidden state after the final norm, returned instead of text; the request runs only its prompt
    # (max_tokens 1: the token sampled with the prompt's last row is dropped by the gateway).
    pooling: str | None = None
    normalize: bool = True  # with pooling: the vector is L2-normalised
    # Set by the engine from the model's generation config, not by callers.
    eos_token_ids: tuple[int, ...] = field(default=(), repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def validate(self, vocab_size: int, max_logprobs: int = 20) -> None:
        """Raise ``InvalidRequest`` (a ``ValueError``) naming every field at fault; change nothing."""
        raise_if_any(self.violations(RequestLimits(vocab_size, 0, max_logprobs)))

    def violations(self, limits: RequestLimits) -> list[Violation]:
        """Every field that breaks a rule, in field order, each named as the client names it. The
        gateway answers with these before anything is queued; the engine refuses on the same list."""
        v: list[Violation] = []

        def bad(field: str, message: str) -> None:
            v.append(Violation(field, message))

        vocab = limits.vocab_size
        _real(bad, "temperature", self.temperature, lambda x: x >= 0, ">= 0")
        _real(bad, "top_p", self.top_p, lambda x: 0 < x <= 1, "in (0, 1]")
        _real(bad, "min_p", self.min_p, lambda x: 0 <= x <= 1, "in [0, 1]")
        _real(bad, "repetition_penalty", self.repetition_penalty, lambda x: x > 0, "> 0")
        for name in ("presence_penalty", "frequency_penalty"):
            _real(bad, name, getattr(self, name), lambda x: -2 <= x <= 2, "in [-2, 2]")
        if _integer(bad, "top_k", self.top_k):
            if self.top_k < -1:
                bad("top_k", f"must be >= -1 (-1 and 0 are off), got {self.top_k}")
            elif self.top_k > vocab:
                bad("top_k", f"must be <= the vocabulary size {vocab}, got {self.top_k}")
        if _integer(bad, "n", self.n):
            _in_range(bad, "n", self.n, 1, limits.max_n)
        if self.seed is not None and _integer(bad, "seed", self.seed):
            _in_range(bad, "seed", self.seed, -(2**63), 2**63 - 1)
        max_tokens_ok = self.max_tokens is None
        if not max_tokens_ok and _integer(bad, "max_tokens", self.max_tokens):
            cap = limits.max_tokens
            if cap is None:
                max_tokens_ok = _in_range(bad, "max_tokens", self.max_tokens, 1, None)
            elif not 1 <= self.max_tokens <= cap:
                bad(
                    "max_tokens",
                    f"must be in [1, {cap}] (the server's limit; the model's context is "
                    f"{limits.max_model_len}), got {self.max_tokens}",
                )
            else:
                max_tokens_ok = True
        if _integer(bad, "min_tokens", self.min_tokens) and _in_range(
            bad, "min_tokens", self.min_tokens, 0, None
        ):
            if max_tokens_ok and self.max_tokens is not None and self.min_tokens > self.max_tokens:
                bad("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _stop_violations(self, limits, bad)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and _integer(bad, name, value):
                _in_range(bad, name, value, 0, limits.max_logprobs)
        if not isinstance(self.speculative, bool):
            bad("speculative", f"must be True or False, got {self.speculative!r}")
        _logit_control_violations(self, vocab, bad)
        _pooling_violations(self, bad)
        if not v:
            _dead_start_violations(self, limits.eos_token_ids, bad)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                bad("structured_outputs", "must be a StructuredOutputsParams")
            else:
                try:
                    self.structured_outputs.kind()
                except ValueError as e:
                    bad("structured_outputs", str(e).removeprefix("structured_outputs: "))
        return v

    @property
    def has_logit_controls(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words_token_ids)


def _stop_violations(p: SamplingParams, limits: RequestLimits, bad) -> None:
    cap, chars = limits.max_stop_strings, limits.max_stop_string_chars
    if cap is not None and len(p.stop) > cap:
        bad("stop", f"at most {cap} stop strings, got {len(p.stop)}")
    for i, s in enumerate(p.stop):
        if not isinstance(s, str) or not s:
            bad(f"stop[{i}]", "must be a non-empty string")
        elif chars is not None and len(s) > chars:
            bad(f"stop[{i}]", f"at most {chars} characters, got {len(s)}")
    ids, cap = p.stop_token_ids, limits.max_stop_token_ids
    if cap is not None and len(ids) > cap:
        bad("stop_token_ids", f"at most {cap} ids, got {len(ids)}")
    for v in token_id_violations(ids, "stop_token_ids", limits.vocab_size):
        bad(v.field, v.message)


def _logit_control_violations(p: SamplingParams, vocab: int, bad) -> None:
    lo, hi = -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            bad("logit_bias", "must map token ids to biases")
        else:
            if len(p.logit_bias) > MAX_LOGIT_CONTROL_IDS:
                bad("logit_bias", f"at most {MAX_LOGIT_CONTROL_IDS} entries, got {len(p.logit_bias)}")
            for tid, bias in p.logit_bias.items():
                if isinstance(tid, bool) or not isinstance(tid, int) or not 0 <= tid < vocab:
                    bad(f"logit_bias[{tid}]", f"names a token id outside the vocabulary [0, {vocab})")
                else:
                    _real(bad, f"logit_bias[{tid}]", bias, lambda x: lo <= x <= hi, f"in [{lo:g}, {hi:g}]")
    if p.allowed_token_ids is not None:
        ids = p.allowed_token_ids
        if not ids or len(ids) > MAX_LOGIT_CONTROL_IDS:
            bad("allowed_token_ids", f"must hold 1 to {MAX_LOGIT_CONTROL_IDS} ids, got {len(ids)}")
        for v in token_id_violations(ids[:MAX_LOGIT_CONTROL_IDS], "allowed_token_ids", vocab):
            bad(v.field, v.message)
    if p.bad_words_token_ids is not None:
        words = p.bad_words_token_ids
        if sum(len(w) for w in words) > MAX_LOGIT_CONTROL_IDS:
            bad("bad_words_token_ids", f"at most {MAX_LOGIT_CONTROL_IDS} tokens in all")
        for i, word in enumerate(words):
            if not word:
                bad(f"bad_words_token_ids[{i}]", "must be at least one token (a bad word)")
            for v in token_id_violations(word, f"bad_words_token_ids[{i}]", vocab):
                bad(v.field, v.message)


POOLING = ("last", "mean")


def _pooling_violations(p: SamplingParams, bad) -> None:
    if p.pooling is None:
        return
    if p.pooling not in POOLING:
        bad("pooling", f"must be one of {', '.join(POOLING)}, got {p.pooling!r}")
    elif p.n != 1 or p.max_tokens != 1:
        bad(
            "pooling",
            f"an embedding request runs only its prompt: needs n 1 and max_tokens 1, got n {p.n}, "
            f"max_tokens {p.max_tokens}",
        )
    elif p.prompt_logprobs is not None or p.structured_outputs is not None:
        bad("pooling", "an embedding request takes no prompt_logprobs or structured_outputs")
    if not isinstance(p.normalize, bool):
        bad("normalize", f"must be True or False, got {p.normalize!r}")


def banned_until_min_tokens(p: SamplingParams, eos_token_ids) -> list[int]:
    """The ids ``min_tokens`` bans until that many tokens are out: the stop ids, and EOS unless
    ignored (``logits_processors/min_tokens.py`` applies it; validation reads it too)."""
    return list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids))


def first_token_bans(p: SamplingParams, eos_token_ids) -> dict[str, set[int]]:
    """The ids each control bans at the request's first token, by the field that bans them: its
    one-token bad words always, and while ``min_tokens`` is unmet its stop ids and (unless ignored)
    EOS (``logits_processors/bad_words.py``, ``min_tokens.py``)."""
    bans = {"bad_words": {w[0] for w in p.bad_words_token_ids or () if len(w) == 1}}
    if p.min_tokens:
        bans["min_tokens"] = set(banned_until_min_tokens(p, eos_token_ids))
    return bans


def _dead_start_violations(p: SamplingParams, eos_token_ids, bad) -> None:
    """allowed_token_ids that the request's other controls ban all of at its first token: it could
    only end without a token, so it is refused up front (a dead end that shows only later, after a
    multi-token bad word's prefix, ends the request at that step with an error naming it)."""
    if not p.allowed_token_ids:
        return
    allowed = set(p.allowed_token_ids)
    bans = first_token_bans(p, eos_token_ids)
    if not allowed <= set().union(*bans.values()):
        return
    why = [
        "bad_words" if name == "bad_words" else f"min_tokens={p.min_tokens} (stop and EOS ids wait for it)"
        for name, ids in bans.items()
        if allowed & ids
    ]
    bad("allowed_token_ids", f"leaves no token to sample: every allowed id is banned by {' and '.join(why)}")


def _integer(bad, name: str, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, int):
        bad(name, f"must be an integer, got {value!r}")
        return False
    return True


def _in_range(bad, name: str, value: int, lo: int, hi: int | None) -> bool:
    if value < lo:
        bad(name, f"must be >= {lo}, got {value}")
    elif hi is not None and value > hi:
        bad(name, f"must be <= {hi}, got {value}")
    else:
        return True
    return False


def _real(bad, name: str, value, ok, rule: str) -> None:
    """A finite number that satisfies ``ok`` (NaN and infinities never do)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        bad(name, f"must be a finite number {rule}, got {value!r}")
    elif not ok(value):
        bad(name, f"must be {rule}, got {value}")
