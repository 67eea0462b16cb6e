"""One sequence's text, as a client sees it: incremental detokenizing (continuing the prompt's
text), then stop strings, then a code completion's line or block rule (tokenizer_svc/code_stop.py).
The gateway's streams and the offline ``LLM`` both use this, so the same tokens give the same text,
and the same stop, whichever API asked."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tokenizer_svc.code_stop import CodeStop
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tokenizer_svc.stop_strings import StopStringMatcher


@dataclass(frozen=True)
class TextStep:
    text: str  # new text that may be sent now
    stop_string: str | None  # the stop string that ended the sequence with this push, else None
    stop_rule: str | None = None  # "line" or "block": a code stop rule ended it with this push


class TextStream:
    def __init__(
        self,
        tokenizer,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
        code_stop: CodeStop | None = None,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens, prompt_ids=prompt_ids)
        self._stop = StopStringMatcher(stop, include_stop_str_in_output) if stop else None
        self._include_stop = include_stop_str_in_output
        self._code = code_stop
        self.done = False  # a stop string matched, or the last tokens came: nothing more is sent

    def push(self, token_ids: Sequence[int], last: bool = False, stop_token: bool = False) -> TextStep:
        """The text that ``token_ids`` make final; ``last`` when the engine finished the sequence
        (an incomplete last character is then released as the tokenizer decodes it).
        ``stop_token``: the last id is the EOS or stop token that ended it; as vLLM does, its text
        is not output (unless ``include_stop_str_in_output``). With special tokens kept in the text
        (a tool format whose markers are special), an ``<|eot_id|>`` would otherwise end the reply."""
        if self.done:
            return TextStep("", None)
        if stop_token and token_ids and not self._include_stop:
            token_ids = token_ids[:-1]
        text = self._detok.push(token_ids)
        if last:
            text += self._detok.flush()
        matched = None
        if self._stop is not None:
            result = self._stop.push(text)
            text, matched = result.text, result.matched
            if matched is None and last:
                text += self._stop.flush()
        rule = None
        if self._code is not None:
            # After the stop strings: a stop string's cut text may still hold the line's end.
            step = self._code.push(text)
            text = step.text
            if step.ended:
                rule, matched = self._code.rule, None
            elif matched is not None or last:
                text += self._code.flush()
        self.done = last or matched is not None or rule is not None
        return TextStep(text, matched, rule)

    def close(self) -> str:
        """The sequence ends early (an abort, a drain): the text held back so far, stop rules kept."""
        if self.done:
            return ""
        self.done = True
        text = self._detok.flush()
        if self._stop is not None:
            result = self._stop.push(text)
            text = result.text if result.matched is not None else result.text + self._stop.flush()
        if self._code is not None:
            text = self._code.push(text).text + self._code.flush()
        return text
