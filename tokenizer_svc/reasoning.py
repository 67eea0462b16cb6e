"""Reasoning parsers (``--reasoning-parser``): the model's thinking between ``<think>`` and
``</think>`` is split out of the output text into ``reasoning_content``.

Like the tool parsers, a parser gives a snapshot of a possibly unfinished text that a longer text
only extends (a marker's beginning is held back), so streamed pieces join to the whole-text split.

- ``deepseek_r1``: the output starts in the reasoning (its template opens ``<think>`` in the
  prompt; an opening ``<think>`` in the output is dropped too) and the answer follows ``</think>``;
  an output that never closes it is all reasoning.
- ``qwen3``: the output reasons only if it opens with ``<think>``; otherwise it is all answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizer_svc.tool_parsers.base import held_prefix

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class ReasoningSplit:
    reasoning: str
    content: str
    ended: bool  # the reasoning is over (or there is none): the answer has begun


class ReasoningParser:
    name = ""
    starts_in_reasoning = True

    def split(self, text: str, final: bool) -> ReasoningSplit:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(OPEN):
            body = body[len(OPEN) :]
        elif not final and OPEN.startswith(body):
            return ReasoningSplit("", "", False)  # empty so far, or the opening marker's beginning
        elif not self.starts_in_reasoning:
            return ReasoningSplit("", text, True)
        end = body.find(CLOSE)
        if end < 0:
            keep = body if final else body[: len(body) - held_prefix(body, CLOSE)]
            return ReasoningSplit(keep, "", False)
        return ReasoningSplit(body[:end], body[end + len(CLOSE) :].lstrip(), True)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
    starts_in_reasoning = False


REASONING_PARSERS = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> ReasoningParser:
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown reasoning parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}"
        )
    return cls()


class ReasoningStream:
    """One sequence's output, delta by delta: the new reasoning, and the new answer text."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self._reasoning = self._content = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.text += delta
        return self._diff(self.parser.split(self.text, False))

    def finish(self) -> tuple[str, str]:
        return self._diff(self.parser.split(self.text, True))

    @property
    def ended(self) -> bool:
        return self.parser.split(self.text, False).ended

    def _diff(self, s: ReasoningSplit) -> tuple[str, str]:
        if not (s.reasoning.startswith(self._reasoning) and s.content.startswith(self._content)):
            raise RuntimeError(f"reasoning parser {self.parser.name} took back output")
        out = s.reasoning[len(self._reasoning) :], s.content[len(self._content) :]
        self._reasoning, self._content = s.reasoning, s.content
        return out
