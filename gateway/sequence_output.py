"""One sequence's engine deltas turned into stream messages: UTF-8-safe text, stop strings, usage."""

from __future__ import annotations

from engine_svc.sampling_params import SamplingParams
from gateway.engine_client import EngineDelta
from llmserve_proto.engine.v1 import engine_pb2 as engine_pb
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.code_stop import CodeStop
from tokenizer_svc.text_stream import TextStream
from tokenizer_svc.tokenizer import Tokenizer

# engine.v1 and llmserve.v1 number their finish reasons alike.
# engine.v1's finish reasons as llmserve.v1 names them.
_FINISH = {
    engine_pb.FINISH_REASON_STOP: pb.FINISH_REASON_STOP,
    engine_pb.FINISH_REASON_LENGTH: pb.FINISH_REASON_LENGTH,
    engine_pb.FINISH_REASON_ABORT: pb.FINISH_REASON_ABORT,
}


def public_logprob(engine_logprob) -> pb.TokenLogprob:
    # The two TokenLogprob messages share field numbers and types, so the bytes of one parse as
    # the other (the engine's extra "absent" flag is only set on entries that are never copied).
    out = pb.TokenLogprob()
    out.ParseFromString(engine_logprob.SerializeToString())
    return out


class SequenceOutput:
    def __init__(
        self,
        request_id: str,
        index: int,
        tokenizer: Tokenizer | None,  # None: token-only mode (no text at all)
        params: SamplingParams,
        prompt_ids: list[int],
        return_token_ids: bool,
        code_stop: tuple[str, int] | None = None,  # stop_at's rule and threshold
    ) -> None:
        self.request_id = request_id
        self.index = index
        self._text = (
            None
            if tokenizer is None
            else TextStream(
                tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
                CodeStop(*code_stop) if code_stop is not None else None,
            )
        )
        self._return_ids = return_token_ids
        self._want_prompt_logprobs = params.prompt_logprobs is not None  # one delta carries them
        self.num_prompt_tokens = len(prompt_ids)
        self.num_cached_tokens = 0
        self.num_draft_tokens = self.num_accepted_draft_tokens = 0
        self.num_tokens = 0
        self.done = False

    def feed(self, d: EngineDelta) -> pb.GenerateResponse | None:
        """The message for this delta, or None when it adds nothing a client could see yet."""
        if self.done:
            return None  # a stop string already ended this sequence; the engine has not caught up
        self.num_tokens += len(d.token_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)
        # Totals so far, not increments: the latest delta's are the sequence's.
        self.num_draft_tokens = max(self.num_draft_tokens, d.num_draft_tokens)
        self.num_accepted_draft_tokens = max(self.num_accepted_draft_tokens, d.num_accepted_draft_tokens)
        engine_finished = d.finish_reason != 0
        if self._text is None:
            text, matched, rule = "", None, None
        else:
            stopped = engine_finished and d.stop_token_id is not None
            step = self._text.push(d.token_ids, last=engine_finished, stop_token=stopped)
            text, matched, rule = step.text, step.stop_string, step.stop_rule
        msg = pb.GenerateResponse(request_id=self.request_id, index=self.index, text=text)
        if self._return_ids:
            msg.token_ids.extend(d.token_ids)
        if d.logprobs:
            msg.logprobs.extend(public_logprob(lp) for lp in d.logprobs)
        if self._want_prompt_logprobs and d.prompt_logprobs:
            msg.prompt_logprobs.extend(public_logprob(lp) for lp in d.prompt_logprobs if not lp.absent)
            self._want_prompt_logprobs = False
        if matched is not None:
            msg.finish_reason = pb.FINISH_REASON_STOP
            msg.stop_string = matched
        elif rule is not None:
            msg.finish_reason = pb.FINISH_REASON_STOP
            msg.stop_rule = rule
        elif engine_finished:
            msg.finish_reason = _FINISH.get(d.finish_reason, pb.FINISH_REASON_ABORT)
            if d.stop_token_id is not None:
                msg.stop_token_id = d.stop_token_id
        if msg.finish_reason:
            self._finish(msg)
        elif not (text or msg.token_ids or msg.logprobs or msg.prompt_logprobs):
            return None
        return msg

    def abort(self) -> pb.GenerateResponse:
        """The server ends this sequence early (drain): release the held text and say so."""
        text = self._text.close() if self._text is not None else ""
        msg = pb.GenerateResponse(
            request_id=self.request_id, index=self.index, text=text, finish_reason=pb.FINISH_REASON_ABORT
        )
        self._finish(msg)
        return msg

    def _finish(self, msg: pb.GenerateResponse) -> None:
        self.done = True
        msg.usage.prompt_tokens = self.num_prompt_tokens
        msg.usage.completion_tokens = self.num_tokens
        msg.usage.cached_prompt_tokens = self.num_cached_tokens
        msg.usage.draft_tokens = self.num_draft_tokens
        msg.usage.accepted_draft_tokens = self.num_accepted_draft_tokens
