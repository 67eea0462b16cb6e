"""llmserve.v1.Generation: validate, admit, tokenize, submit, then stream each sequence's deltas.

Everything a client can get wrong is refused before the engine hears of the request. Once the
request is in the engine, whatever ends the handler (the last sequence finished, a stop string,
the client's cancel or deadline, a drain) leaves nothing behind in the engine: the ``finally``
aborts whatever the engine still runs for it.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from engine_svc.rpc.convert import sampling_params_to_proto
from engine_svc.rpc.log_setup import request_scope
from engine_svc.structured_outputs import StructuredOutputsParams
from gateway.auth import Identity
from gateway.chat_output import ChatOutput
from gateway.constraints import complete_constraints
from gateway.embed_sink import EmbedSink
from gateway.engine_client import EngineUnavailable
from gateway.errors import FieldViolation, RequestError, invalid, refuse, unavailable
from gateway.gateway_state import GatewayState, ServerAborting
from gateway.infill import (
    PROTO_NAMES,
    InfillNames,
    check_infill,
    cut_step,
    fim_pieces,
    infill_ids,
    spec_or_refuse,
)
from gateway.input_bounds import check_chat, check_lora_name, check_text
from gateway.metrics import RequestMetrics
from gateway.quoting import clip, quote
from gateway.sequence_output import SequenceOutput
from gateway.stall_sweep import StreamControl
from gateway.supersede import Superseded
from gateway.token_only import check_generate, refuse_text_call
from gateway.tool_request import Names, ToolPlan, chat_messages, plan_tools
from gateway.validation import check_prompt_length, validate_generate
from llmserve_proto.llmserve.v1 import generation_pb2 as pb
from llmserve_proto.llmserve.v1 import generation_pb2_grpc as pb_grpc
from tokenizer_svc.pool import TokenizerWorkerDied, TokenizerWorkerError
from tokenizer_svc.reasoning import get_reasoning_parser
from tokenizer_svc.reasoning_grammar import after_reasoning
from tokenizer_svc.tool_parsers.markers import marker_for

log = logging.getLogger("gateway.requests")
FINISH_OUTCOMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_ABORT: "abort",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(self, state: GatewayState) -> None:
        self.s = state

    async def GenerateStream(
        self, request: pb.GenerateRequest, context
    ) -> AsyncIterator[pb.GenerateResponse]:
        # The stall sweep ends this call from outside if its client stops reading (stall_sweep.py).
        control = StreamControl(asyncio.current_task(), context, log_id="")
        try:
            async for msg in self._observed(request, context, control):
                yield msg
        except RequestError as e:
            refuse(context, e)

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        try:
            sequences: dict[int, pb.GenerateResponse] = {}
            async for msg in self._observed(request, context):
                whole = sequences.setdefault(
                    msg.index, pb.GenerateResponse(request_id=msg.request_id, index=msg.index)
                )
                whole.text += msg.text
                whole.reasoning_content += msg.reasoning_content
                merge_tool_calls(whole.tool_calls, msg.tool_calls)
                whole.token_ids.extend(msg.token_ids)
                whole.logprobs.extend(msg.logprobs)
                whole.prompt_logprobs.extend(msg.prompt_logprobs)
                if msg.finish_reason:
                    whole.finish_reason = msg.finish_reason
                    whole.usage.CopyFrom(msg.usage)
                    reason = msg.WhichOneof("stop_reason")
                    if reason is not None:
                        setattr(whole, reason, getattr(msg, reason))
        except RequestError as e:
            refuse(context, e)
            return pb.GenerateResponse()
        first, *rest = (sequences[i] for i in sorted(sequences))
        first.additional_sequences.extend(rest)
        return first

    async def Tokenize(self, request: pb.TokenizeRequest, context) -> pb.TokenizeResponse:
        try:
            return await self.tokenize(request)
        except RequestError as e:
            refuse(context, e)
            return pb.TokenizeResponse()

    async def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """Tokenize for any front end; a refusal is raised as a RequestError."""
        self.s.check_model(request.model)
        if self.s.token_only:
            refuse_text_call(request.WhichOneof("input") or "text", "tokenizing")
        kind = request.WhichOneof("input")
        if kind == "text":
            bad = check_text(request.text, "text", self.s.limits)
            if bad:
                raise invalid(bad)
            add = request.add_special_tokens if request.HasField("add_special_tokens") else True
            ids = await self._tokenized(
                self.s.tokenization.encode(
                    request.text,
                    add_special_tokens=add,
                    parse_special_tokens=request.allow_special_tokens,
                ),
                "text",
            )
        elif kind == "chat":
            bad = check_chat(request.chat.messages, "chat.messages", self.s.limits)
            if bad:
                raise invalid(bad)
            add = (
                request.chat.add_generation_prompt if request.chat.HasField("add_generation_prompt") else True
            )
            v: list[FieldViolation] = []
            messages = chat_messages(
                request.chat.messages, Names(), lambda f, why: v.append(FieldViolation(f, why))
            )
            chat = pb.Chat()
            chat.CopyFrom(request.chat)
            chat.tool_choice.mode = pb.ToolChoice.MODE_NONE  # the tools are rendered; nothing is parsed
            plan = plan_tools(chat, self.s.tool_options, False, marker_for(self.s.tokenizer))
            if v or plan.violations:
                raise invalid(v + plan.violations)
            ids = await self._chat_ids(messages, add, plan.tools, _thinking(request.chat))
        else:
            raise invalid([FieldViolation("input", "one of text or chat is required")])
        return pb.TokenizeResponse(token_ids=ids, count=len(ids), max_model_len=self._max_model_len())

    async def Detokenize(self, request: pb.DetokenizeRequest, context) -> pb.DetokenizeResponse:
        try:
            return await self.detokenize(request)
        except RequestError as e:
            refuse(context, e)
            return pb.DetokenizeResponse()

    async def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        """Detokenize for any front end; a refusal is raised as a RequestError."""
        self.s.check_model(request.model)
        if self.s.token_only:
            refuse_text_call("token_ids", "detokenizing")
        count, cap = len(request.token_ids), self.s.limits.max_detokenize_ids
        if count > cap:
            raise invalid(
                [FieldViolation("token_ids", f"has {count} ids; the limit is max_detokenize_ids={cap}")]
            )
        vocab = self.s.tokenizer.vocab_size
        for i, t in enumerate(request.token_ids):
            if not 0 <= t < vocab:
                raise invalid(
                    [FieldViolation(f"token_ids[{i}]", f"{t} is outside the vocabulary [0, {vocab})")]
                )
        skip = request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        # In a worker: a long decode must not hold up the event loop's other streams.
        text = await self._tokenized(
            self.s.tokenization.decode(list(request.token_ids), skip_special_tokens=skip), "token_ids"
        )
        return pb.DetokenizeResponse(text=text)

    # ----------------------------------------------------------------------------------------------

    def _max_model_len(self) -> int:
        return self.s.engine.info.max_model_len if self.s.engine.info else 0

    async def _prompt_ids(self, v, tools: list[dict] | None) -> list[int]:
        if v.prompt_kind == "token_ids":
            return v.token_ids
        if v.prompt_kind == "text":
            encoding = self.s.tokenization.encode(v.text, parse_special_tokens=v.allow_special_tokens)
            return await self._tokenized(encoding, "text")
        return await self._chat_ids(v.chat, v.add_generation_prompt, tools, v.enable_thinking)

    async def _chat_ids(
        self,
        messages: list[dict],
        add_generation_prompt: bool,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        pool = self.s.tokenization
        ids = pool.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            enable_thinking=enable_thinking,
        )
        return await self._tokenized(ids, "chat")

    def _plan_tools(self, request: pb.GenerateRequest, v, names: Names | None) -> ToolPlan | None:
        """A chat's tools: checked, and what they change (the grammar of a forced call, special
        tokens kept in the text where the call format's markers are special tokens)."""
        if v.prompt_kind != "chat":
            return None
        chat, cap = request.chat, self.s.limits.max_prompt_chars
        size = sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
        size += sum(len(c.name) + len(c.arguments) for m in chat.messages for c in m.tool_calls)
        if size > cap:  # the tools and the history's calls are prompt text too
            field = (names or Names()).tool_list
            raise invalid(
                [
                    FieldViolation(
                        field,
                        f"tools and tool calls have {size} characters; the limit is max_prompt_chars={cap}",
                    )
                ]
            )
        plan = plan_tools(
            request.chat,
            self.s.tool_options,
            v.params.structured_outputs is not None,
            marker_for(self.s.tokenizer),
            names,
        )
        if plan.violations:
            raise invalid(plan.violations)
        if plan.grammar is not None:
            v.params.structured_outputs = StructuredOutputsParams(grammar=plan.grammar)
        if plan.parser is not None and plan.parser.needs_special_tokens:
            v.params.skip_special_tokens = False
        reasoning = self.s.tool_options.reasoning_parser
        if reasoning is not None and v.params.structured_outputs is not None:  # never inside the thinking
            v.params.structured_outputs = after_reasoning(
                v.params.structured_outputs, get_reasoning_parser(reasoning), marker_for(self.s.tokenizer)
            )
        return plan

    def _plan_infill(self, request: pb.GenerateRequest, v, names: InfillNames):
        """A fill-in-the-middle request: the model's format (or the refusal that names what it
        lacks), the pieces checked and laid out, and the format's end tokens added to the stops."""
        if v.prompt_kind != "infill":
            return None
        spec = spec_or_refuse(self.s.fim, names)
        pieces = fim_pieces(spec, check_infill(request.infill, self.s.limits, names), names)
        stops = v.params.stop_token_ids
        stops.extend(t for t in spec.end_ids if t not in stops)
        return spec, pieces

    async def _infill_ids(self, fim, v, fill: bool) -> list[int]:
        spec, pieces = fim
        s = self.s
        info = s.engine.info
        # The room the prompt may take: the context less what is asked for (less a reserve when
        # max_tokens is the rest of the context), within --max-prompt-tokens.
        reserve = v.params.max_tokens
        if fill:
            reserve = min(max(s.limits.default_max_tokens, 256), s.max_model_len // 4)
        room = min(s.max_model_len - reserve, s.limits.prompt_token_limit(s.max_model_len))
        room = max(room, 1)
        step = cut_step(info.block_size if info else 16, room)
        return await self._tokenized(infill_ids(spec, pieces, s.tokenization.encode, room, step), "infill")

    @staticmethod
    async def _tokenized(call, field: str) -> list[int]:
        try:
            return await call
        except ValueError as e:  # the text or chat itself is at fault (e.g. the template refused it)
            raise invalid([FieldViolation(field, clip(str(e)))]) from e
        except TokenizerWorkerDied as e:
            raise unavailable(f"tokenizer workers are unavailable: {e}") from e
        except TokenizerWorkerError as e:
            raise RequestError(grpc.StatusCode.INTERNAL, f"tokenizing failed: {e}") from e

    def _prompt_fields(self, request: pb.GenerateRequest, kind: str | None) -> dict:
        """The request line's facts about the prompt, at a cost bounded by the limits: a chat over
        the message limit is only counted (it is refused next)."""
        messages, lim = request.chat.messages, self.s.limits
        chat = text = None
        if kind == "chat" and len(messages) <= lim.max_chat_messages:
            chat = [{"role": m.role, "content": m.content} for m in messages]
            if sum(len(m["role"]) + len(m["content"]) for m in chat) > lim.max_prompt_chars:
                chat = None  # refused next; counted, never logged whole
        if kind == "text" and len(request.text) <= lim.max_prompt_chars:
            text = request.text  # (--log-prompts logs it whole: only within the limit)
        fields = self.s.prompt_log.fields(
            text=text, chat=chat, num_tokens=len(request.token_ids.ids) if kind == "token_ids" else None
        )
        if kind == "chat" and chat is None:
            fields["chat_messages"] = len(messages)
        if kind == "text" and text is None:
            fields["prompt_chars"] = len(request.text)
        return fields

    def _observed(
        self, request: pb.GenerateRequest, context, control: StreamControl | None = None
    ) -> AsyncIterator[pb.GenerateResponse]:
        return self.run(
            request, self.s.auth.identity_of(context), context.time_remaining, control, client=context.peer()
        )

    async def run(
        self,
        request: pb.GenerateRequest,
        identity: Identity,
        time_remaining: Callable[[], float | None] = lambda: None,
        control: StreamControl | None = None,
        fill_context: bool = False,
        on_prompt: Callable[[list[int]], None] | None = None,
        client: str | None = None,
        tool_names: Names | None = None,
        embed: EmbedSink | None = None,
        max_tokens_cap: int | None = None,
        infill_names: InfillNames = PROTO_NAMES,
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The one generation path, for any front end (gRPC here, HTTP in ``http_api``): one
        request's log lines (its id on each), metrics and outcome, around ``_generate``.
        ``identity`` is the authenticated caller; ``time_remaining`` its deadline (None: none);
        ``control`` lets the stall sweep end a stream whose client stopped reading.
        ``fill_context``: an unset max_tokens is the rest of the context (OpenAI's API, as vLLM
        serves it) instead of the server's default. ``on_prompt`` is told the prompt's token ids
        once they are known (before the first message). ``client`` names the caller's connection
        for admission's share of slots kept for new clients (None: counted as a new client).
        ``tool_names``: how violations of the tools name their fields (the HTTP API's own names;
        default the proto's). ``embed``: an embedding request (gateway/embedding_service.py): the
        prompt runs with its pooling and the vector lands in ``embed``.
        ``max_tokens_cap`` (with ``fill_context`` and max_tokens unset): the
        client's max_tokens, clamped to the context the prompt leaves (Anthropic's Messages API,
        whose clients ask for more than a small model holds). ``infill_names``: how violations of a
        fill-in-the-middle request name its pieces (the door's own names; default the proto's)."""
        rid = request.request_id or uuid.uuid4().hex
        rm = self.s.metrics.request()
        outcome = "internal"
        # The id is the client's text and is checked only later: a forged one (newlines, a
        # megabyte) must not reach a log line as it is.
        log_id = rid if len(rid) <= 256 and rid.isprintable() else f"unprintable-{hash(rid) & 0xFFFFFFFF:08x}"
        if control is not None:
            control.log_id = log_id
            control.metrics = rm
        with request_scope(log_id):
            kind = request.WhichOneof("prompt")
            log.info(
                "request",
                extra={
                    "fields": {
                        "tenant": identity.tenant or None,
                        "prompt_kind": kind,
                        **self._prompt_fields(request, kind),
                        "n": request.n if request.HasField("n") else 1,
                        "max_tokens": request.max_tokens if request.HasField("max_tokens") else None,
                    }
                },
            )
            try:
                stream = self._generate(
                    request,
                    rid,
                    identity.cache_salt,
                    rm,
                    control,
                    fill_context,
                    on_prompt,
                    client,
                    tool_names,
                    embed,
                    max_tokens_cap,
                    infill_names,
                )
                async for msg in stream:
                    if msg.finish_reason:
                        outcome = FINISH_OUTCOMES.get(msg.finish_reason, "unknown")
                    yield msg
            except RequestError as e:
                outcome = e.code.name.lower()
                # Field names only for bad input: a description may quote what the client sent.
                why = [v.field for v in e.violations] if e.violations else e.message
                log.info("refused: %s", e.code.name, extra={"fields": {"reason": why}})
                raise
            except (asyncio.CancelledError, GeneratorExit):
                remaining = time_remaining()
                if control is not None and control.stalled:
                    outcome = control.outcome  # the client stopped reading: stalled or shed (stall_sweep.py)
                elif remaining is not None and remaining <= 0:
                    outcome = "deadline_exceeded"
                else:
                    outcome = "cancelled"
                raise
            except Exception:
                log.exception("request failed")
                raise
            finally:
                rm.finish(outcome)
                fields = {"outcome": outcome, "completion_tokens": rm.sent_tokens}
                if rm.unconfirmed_tokens:  # ended mid-send (its client stopped reading, or left)
                    fields["unconfirmed_tokens"] = rm.unconfirmed_tokens
                log.info("finished", extra={"fields": {**fields, **rm.summary()}})

    async def _generate(
        self,
        request: pb.GenerateRequest,
        rid: str,
        cache_salt: str,
        rm: RequestMetrics,
        control: StreamControl | None = None,
        fill_context: bool = False,
        on_prompt: Callable[[list[int]], None] | None = None,
        client: str | None = None,
        tool_names: Names | None = None,
        embed: EmbedSink | None = None,
        max_tokens_cap: int | None = None,
        infill_names: InfillNames = PROTO_NAMES,
    ) -> AsyncIterator[pb.GenerateResponse]:
        s = self.s
        fill = fill_context and not request.HasField("max_tokens")
        if fill:  # validated against the largest value; the prompt's length sets it below
            request = _with_max_tokens(request, s.limits.max_tokens_limit(s.max_model_len))
        s.check_serving()
        s.check_model(request.model)
        if s.token_only:
            check_generate(request)
        bad_lora = check_lora_name(request.lora)
        if bad_lora:
            raise invalid(bad_lora)
        v = validate_generate(request, s.vocab_size, s.max_model_len, s.limits, s.eos_token_ids)
        if s.token_only:
            v.return_token_ids = True  # token ids are the only output there is
        if embed is not None:
            v.params.pooling, v.params.normalize = embed.pooling, embed.normalize
        plan = self._plan_tools(request, v, tool_names)
        fim = self._plan_infill(request, v, infill_names)
        if rid in s.inflight:
            raise RequestError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request_id {rid!r} is already in flight",
                [FieldViolation("request_id", "must be unique among the requests in flight")],
            )
        s.inflight[rid] = None
        key = request.supersede_key
        claim = s.supersede.claim(cache_salt, key, rid) if key else None
        try:
            async with s.admission.slot(client) as slot:
                encode = s.tokenization.encode if s.tokenization is not None else None  # token-only: no words
                await complete_constraints(v.params, list(request.bad_words), encode)
                if fim is not None:
                    prompt = await self._infill_ids(fim, v, fill)
                else:
                    prompt = await self._prompt_ids(v, plan.tools if plan is not None else None)
                max_prompt = s.limits.max_prompt_tokens
                info = s.engine.info
                if fill:
                    v.params.max_tokens = _rest_of_context(len(prompt), v.params, s.max_model_len, info)
                    if max_tokens_cap is not None:
                        v.params.max_tokens = max(min(v.params.max_tokens, max_tokens_cap), 1)
                check_prompt_length(
                    len(prompt),
                    v.params.max_tokens,
                    s.max_model_len,
                    v.prompt_kind,
                    max_prompt,
                    info.block_size,
                    info.num_kv_blocks,
                )
                s.check_serving()  # tokenizing took time: the engine may have gone, or a drain begun
                rm.prompt(len(prompt))
                if on_prompt is not None:
                    on_prompt(prompt)
                if claim is not None and claim.superseded_by is not None:  # while it was tokenized
                    raise _superseded(claim.superseded_by)
                try:
                    handle = await s.engine.submit(
                        rid,
                        prompt,
                        sampling_params_to_proto(v.params),
                        v.priority,
                        cache_salt=cache_salt,
                        lora=request.lora,
                        client=client or "",
                    )
                except EngineUnavailable as e:
                    raise unavailable(str(e)) from e
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise invalid([FieldViolation("prompt", e.details())]) from e
                    raise RequestError(e.code(), e.details()) from e
                s.inflight[rid] = handle
                if claim is not None:
                    claim.attach(handle)
                if control is not None:
                    control.handle = handle
                    s.streams[rid] = control
                    # Paused because its client does not read: its slot is another's meanwhile.
                    handle.watch_pause(slot.set_paused)
                try:
                    async for msg in self._stream(rid, handle, v, prompt, rm, plan, embed):
                        yield msg
                finally:
                    s.streams.pop(rid, None)
                    s.engine.release(rid)
                    if not handle.finished:  # cancelled, deadline, stop string, drain: free its blocks
                        s.in_background(s.engine.abort([rid]))
                        handle.finished = True
        finally:
            del s.inflight[rid]
            if claim is not None:
                s.supersede.release(cache_salt, key, claim)

    async def _stream(
        self,
        rid: str,
        handle,
        v,
        prompt: list[int],
        rm: RequestMetrics,
        plan: ToolPlan | None = None,
        embed: EmbedSink | None = None,
    ) -> AsyncIterator[pb.GenerateResponse]:
        seqs = [
            SequenceOutput(rid, i, self.s.tokenizer, v.params, prompt, v.return_token_ids, v.code_stop)
            for i in range(v.n)
        ]
        outputs = self._chat_outputs(v, plan)
        remaining = v.n
        unsent = 0  # tokens fed since the last message gRPC took
        while remaining:
            try:
                deltas = await handle.next_deltas()
            except EngineUnavailable as e:
                raise unavailable(str(e)) from e
            except Superseded as e:
                raise _superseded(str(e)) from None
            except ServerAborting:
                for seq in seqs:
                    if not seq.done:
                        msg = seq.abort()
                        yield outputs[seq.index].apply(msg) if outputs else msg
                return
            for d in deltas:
                if d.error:  # its constraint did not compile for this vocabulary, or left it no token
                    raise invalid([FieldViolation("constraint", d.error)])
                seq = seqs[d.index]
                if embed is not None and d.embedding:
                    embed.vector, embed.prompt_tokens = d.embedding, len(prompt)
                if seq.done:
                    continue
                rm.tokens(d.index, len(d.token_ids))
                unsent += len(d.token_ids)
                msg = seq.feed(d)
                if msg is None:
                    continue
                if outputs:
                    msg = outputs[d.index].apply(msg)
                if seq.done:
                    remaining -= 1
                    if not d.finish_reason and remaining:
                        # A stop string ended this sequence while the engine runs it and its
                        # siblings go on: drop just it.
                        self.s.in_background(self.s.engine.abort([rid], index=d.index))
                rm.unconfirmed_tokens = unsent
                handle.sending(True)
                yield msg  # returns once gRPC has taken the message (a stream's send completed)
                handle.sending(False)
                rm.sent_tokens += unsent
                rm.unconfirmed_tokens = unsent = 0

    def _chat_outputs(self, v, plan: ToolPlan | None) -> list[ChatOutput] | None:
        """Per sequence, what takes the reasoning and the calls out of a chat's text (None: the text
        is all content)."""
        if v.prompt_kind != "chat" or self.s.token_only:
            return None
        name = self.s.tool_options.reasoning_parser
        parser = plan.parser if plan is not None else None
        if parser is None and name is None:
            return None
        return [ChatOutput(parser, get_reasoning_parser(name) if name else None) for _ in range(v.n)]


def merge_tool_calls(whole, pieces) -> None:
    """Stream pieces of calls into whole calls: a new index starts a call, later pieces extend its
    arguments."""
    for piece in pieces:
        if piece.index == len(whole):
            whole.add(index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments)
        else:
            whole[piece.index].arguments += piece.arguments


def _superseded(by: str) -> RequestError:
    return RequestError(
        grpc.StatusCode.CANCELLED, f"superseded by request {quote(by)} with the same supersede_key"
    )


def _with_max_tokens(request: pb.GenerateRequest, max_tokens: int) -> pb.GenerateRequest:
    out = pb.GenerateRequest()
    out.CopyFrom(request)
    out.max_tokens = max_tokens
    return out


def _rest_of_context(num_prompt_tokens: int, params, max_model_len: int, info) -> int:
    """max_tokens for a request that left it unset (vLLM's rule: the rest of the context), also
    held within what the engine's whole KV pool can hold, so that the default itself is never
    the reason for a refusal. At least 1 and min_tokens: a prompt that fills the context is refused
    by the length check with its own words."""
    rest = min(params.max_tokens, max_model_len - num_prompt_tokens)
    if info.block_size and info.num_kv_blocks:
        rest = min(rest, info.block_size * info.num_kv_blocks - num_prompt_tokens)
    return max(rest, params.min_tokens, 1)


def _thinking(chat: pb.Chat) -> bool | None:
    """The chat template's ``enable_thinking`` the request sets (None: not passed)."""
    return chat.enable_thinking if chat.HasField("enable_thinking") else None
