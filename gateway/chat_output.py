"""One chat sequence's stream messages with the reasoning and the tool calls taken out of the text.

Applied to each ``GenerateResponse`` that ``SequenceOutput`` makes: the text goes through the
reasoning parser (if the server has one), then the answer part through the tool-call parser (if
the request's tools are parsed); ``text`` keeps only the content, ``reasoning_content`` and
``tool_calls`` get the rest. A sequence that ended normally after calling tools finishes with
``FINISH_REASON_TOOL_CALLS``.

A call is sent only once its arguments are a whole JSON object: its pieces are held until then, so
a call that the token limit (or an end of text) cuts short is never returned as a call, streamed
or whole (its text is dropped; the finish reason says why the output ended).
"""

from __future__ import annotations

import logging

from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.reasoning import ReasoningParser, ReasoningStream
from tokenizer_svc.tool_parsers import ToolCallStream, ToolParser
from tokenizer_svc.tool_parsers.base import whole_object

log = logging.getLogger("gateway.tools")


class ChatOutput:
    def __init__(self, tool_parser: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallStream(tool_parser) if tool_parser is not None else None
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.ids: list[str] = []
        self.num_calls = 0
        self._held: dict[int, list] = {}  # index -> [name, arguments] of a call not yet whole
        self._sent = 0  # calls sent (indexes below this one are whole and out)

    def apply(self, msg: pb.GenerateResponse) -> pb.GenerateResponse:
        last = bool(msg.finish_reason)
        text = msg.text
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text)
            if last:
                more_thought, more = self.reasoning.finish()
                thought, text = thought + more_thought, text + more
            msg.reasoning_content = thought
        if self.tools is not None:
            delta = self.tools.feed(text)
            if last:
                end = self.tools.finish()
                delta.content += end.content
                delta.calls += end.calls
            text = delta.content
            for c in delta.calls:
                held = self._held.setdefault(c.index, [c.name, ""])
                held[1] += c.arguments
            while self._sent in self._held and whole_object(self._held[self._sent][1]):
                name, arguments = self._held.pop(self._sent)
                self.ids.append(self.tools.parser.call_id())
                msg.tool_calls.add(index=self._sent, id=self.ids[-1], name=name, arguments=arguments)
                self._sent += 1
            if last and self._held:
                log.info(
                    "dropped %d unfinished tool call(s) (finish: %s)",
                    len(self._held),
                    pb.FinishReason.Name(msg.finish_reason),
                )
                self._held.clear()
            self.num_calls = len(self.ids)
            if last and self.num_calls and msg.finish_reason == pb.FINISH_REASON_STOP:
                msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        msg.text = text
        return msg
