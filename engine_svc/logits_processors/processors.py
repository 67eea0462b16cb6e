"""The logit controls in the order the sampler applies them: constraints first (grammar mask,
then allowed ids, then bias), then, after logprobs are read, bans and penalties."""

from __future__ import annotations

from engine_svc.logits_processors.allowed_ids import AllowedIds
from engine_svc.logits_processors.bad_words import BadWords
from engine_svc.logits_processors.base import LogitsProcessor
from engine_svc.logits_processors.grammar import GrammarMask
from engine_svc.logits_processors.logit_bias import LogitBias
from engine_svc.logits_processors.min_tokens import MinTokens
from engine_svc.logits_processors.penalties import Penalties


def default_processors() -> list[LogitsProcessor]:
    return [GrammarMask(), AllowedIds(), LogitBias(), MinTokens(), BadWords(), Penalties()]
