"""One chat sequence's stream messages with the reasoning and the tool calls taken out of the text.

Applied to each ``GenerateResponse`` that ``SequenceOutput`` makes: the text goes through the
reasoning parser (if the server has one), then the answer part through the tool-call parser (if
the request's tools are parsed); ``text`` keeps only the content, ``reasoning_content`` and
``tool_calls`` get the rest. A sequence that ended normally after calling tools finishes with
``FINISH_REASON_TOOL_CALLS``.
"""

from __future__ import annotations

from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from tokenizer_svc.reasoning import ReasoningParser, ReasoningStream
from tokenizer_svc.tool_parsers import ToolCallStream, ToolParser


class ChatOutput:
    def __init__(self, tool_parser: ToolParser | None, reasoning: ReasoningParser | None) -> None:
        self.tools = ToolCallStream(tool_parser) if tool_parser is not None else None
        self.reasoning = ReasoningStream(reasoning) if reasoning is not None else None
        self.ids: list[str] = []
        self.num_calls = 0

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
            for c in _merged(delta.calls):
                out = msg.tool_calls.add(index=c.index, arguments=c.arguments)
                if c.name is not None:
                    self.ids.append(self.tools.parser.call_id())
                    out.id, out.name = self.ids[c.index], c.name
            self.num_calls = len(self.ids)
            if last and self.num_calls and msg.finish_reason == pb.FINISH_REASON_STOP:
                msg.finish_reason = pb.FINISH_REASON_TOOL_CALLS
        msg.text = text
        return msg


def _merged(calls):
    """A delta's pieces of one call as one piece (the finish may add to a call the feed began)."""
    out = []
    for c in calls:
        if out and out[-1].index == c.index:
            out[-1].arguments += c.arguments
        else:
            out.append(c)
    return out
