"""The offline API, in the shape vLLM users know: ``LLM(model=...).generate(prompts, params)``.

Text lives here, not in the engine: string prompts are tokenized, and outputs go through the
same text pipeline as the gateway's streams (``tokenizer_svc.text_stream``): incremental
detokenizing that continues the prompt, then stop strings; a match finishes that sequence with an
abort to the engine, and nothing after the match is returned.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from engine_svc.config import EngineConfig
from engine_svc.engine import LLMEngine
from engine_svc.gc_freeze import return_freed_memory
from engine_svc.lora.request import LoRARequest
from engine_svc.outputs import CompletionOutput, RequestDelta, RequestOutput
from engine_svc.pooling import decode_vector
from engine_svc.sampling_params import SamplingParams

# ``decode_stall_factor`` when ``LLM`` is not given one: off (EngineConfig's None is the served default).
OFFLINE_DECODE_STALL_FACTOR = 0.0
# ``max_seqs_per_step`` when ``LLM`` is not given one: None seats every running sequence in each step
# (``max_num_seqs``, as vLLM's offline batch is max_num_seqs wide); the server's CPU default (16 a
# thread, config.py) bounds a slow reader's wait, and offline no stream waits.
OFFLINE_MAX_SEQS_PER_STEP: int | None = None


class LLM:
    def __init__(
        self,
        model: str,
        tokenizer: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        dtype: str | None = None,
        device: str | None = None,
        load_format: str = "auto",
        seed: int = 0,
        tensor_parallel_size: int = 1,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        **engine_options,
    ):
        """``tool_call_parser`` (hermes, llama3_json, mistral, pythonic) and ``reasoning_parser``
        (deepseek_r1, qwen3): what ``chat`` reads calls and thinking out of the reply with, as
        ``llmserve serve --tool-call-parser / --reasoning-parser`` do."""
        from tokenizer_svc.reasoning import get_reasoning_parser
        from tokenizer_svc.tool_parsers import get_parser

        # Checked before the model loads: a wrong name fails fast, with the list of names.
        self.tool_parser = get_parser(tool_call_parser) if tool_call_parser else None
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None
        # Nothing reads a token before ``generate`` returns: no stream waits on inter-token latency,
        # so the served default's decode stall cap (a latency guarantee, at a throughput cost) is off
        # unless asked for; steps are planned by the work budget alone, as vLLM's offline LLM plans
        # by its token budget (docs/performance.md#real-models-against-vllm-cpu).
        engine_options.setdefault("decode_stall_factor", OFFLINE_DECODE_STALL_FACTOR)
        # Likewise the step's seats: the served CPU default exists for readers that fall behind
        # (docs/slow-readers.md); offline every running sequence takes each step (wider GEMMs).
        # An explicit None asks for the served default.
        engine_options.setdefault("max_seqs_per_step", OFFLINE_MAX_SEQS_PER_STEP or max_num_seqs)
        config = EngineConfig(
            model=str(model),
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            kv_cache_memory=kv_cache_memory,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            dtype=dtype,
            device=device,
            load_format=load_format,
            seed=seed,
            tensor_parallel_size=tensor_parallel_size,
            **engine_options,
        )
        self.engine = LLMEngine(config)
        from tokenizer_svc.tokenizer import load_tokenizer
        from tokenizer_svc.tokenizer_files import find_tokenizer_dir

        tok_dir = find_tokenizer_dir(tokenizer or model)
        self.tokenizer = None if tok_dir is None else load_tokenizer(tok_dir)
        return_freed_memory()  # what reading a GGUF's tokenizer left freed (as the engine's load)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def shutdown(self) -> None:
        """Stop tensor-parallel worker processes, if any."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of ``prompts``.
        ``lora_request``: one adapter for every prompt, or one (or None: the base model) per prompt;
        an adapter not loaded yet is loaded from its ``lora_path`` first."""
        prompt_list = _as_prompt_list(prompts)
        params_list = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(prompt_list)
        )
        if len(params_list) != len(prompt_list):
            raise ValueError(f"got {len(params_list)} sampling params for {len(prompt_list)} prompts")
        loras = lora_request if isinstance(lora_request, list) else [lora_request] * len(prompt_list)
        if len(loras) != len(prompt_list):
            raise ValueError(f"got {len(loras)} lora requests for {len(prompt_list)} prompts")
        names = [self._ensure_lora(r) for r in loras]
        tracks: dict[str, _Track] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
                track = self._start(prompt, params, priority[i] if priority else 0, names[i])
                tracks[track.request_id] = track
            with tqdm(total=len(tracks), disable=not use_tqdm, desc="generate") as bar:
                while self.engine.has_unfinished_requests():
                    for delta in self.engine.step():
                        track = tracks[delta.request_id]
                        was_finished = track.finished
                        track.consume(delta, self.engine)
                        if track.finished and not was_finished:
                            bar.update(1)
        finally:
            for rid in tracks:
                self.engine.abort_request(rid)  # on an error mid-way, leave nothing behind
        return [t.result() for t in tracks.values()]

    def embed(self, prompts, pooling: str = "last", normalize: bool = True) -> list[np.ndarray]:
        """One float32 vector per prompt (text or token ids), in order: the model's final hidden
        state after its final norm, pooled ("last" or "mean") and L2-normalised unless
        ``normalize`` is False (engine_svc/pooling.py). The prompts share the engine's steps."""
        params = SamplingParams(max_tokens=1, temperature=0.0, pooling=pooling, normalize=normalize)
        ids: list[str] = []
        vectors: dict[str, np.ndarray] = {}
        try:
            for prompt in _as_prompt_list(prompts):
                ids.append(self._start(prompt, params, 0).request_id)
            while self.engine.has_unfinished_requests():
                for delta in self.engine.step():
                    if delta.embedding is not None:
                        vectors[delta.request_id] = decode_vector(delta.embedding).copy()
        finally:
            for rid in ids:
                self.engine.abort_request(rid)  # on an error mid-way, leave nothing behind
        return [vectors[rid] for rid in ids]

    def chat(
        self,
        messages,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}`` dicts) or to a
        list of them; one output per conversation, in order. The prompt is the model's chat
        template (or ``chat_template``, a Jinja string) applied the gateway's way: the template's
        markers are special tokens, the messages' text never is. ``tools``: functions in HF's
        convention (``{"type": "function", "function": {"name", "description", "parameters"}}``),
        rendered by the template as its ``tools`` variable; history messages may hold
        ``tool_calls`` (arguments as dicts) and ``role: "tool"`` results.

        With a ``tool_call_parser`` (see ``LLM``), calls are read out of the reply as the server
        reads them: each output's ``tool_calls`` (id, name, arguments as JSON text), ``text`` the
        content left, finish reason "tool_calls". ``tool_choice``: "auto" (the default: free text
        or well-formed calls), "required", ``{"type": "function", "function": {"name": ...}}``
        (decoded under a grammar of the tools' schemas, so the calls always parse), or "none";
        ``parallel_tool_calls=False``: at most one call. With a ``reasoning_parser``, the thinking
        goes to ``reasoning_content`` and any constraint applies after it. Bad tools or choices
        raise ``ValueError`` naming the argument."""
        from engine_svc.offline_chat import check_tools, plan_chat, split_output

        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none (a token-only model directory)")
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation (a list of message dicts) or a list of them")
        conversations = messages if isinstance(messages[0], list) else [messages]
        tools = check_tools(tools)
        params_list = (
            sampling_params
            if isinstance(sampling_params, list)
            else [sampling_params or SamplingParams()] * len(conversations)
        )
        if len(params_list) != len(conversations):
            raise ValueError(f"got {len(params_list)} sampling params for {len(conversations)} conversations")
        plans = [
            plan_chat(
                p,
                tools,
                tool_choice,
                parallel_tool_calls,
                self.tool_parser,
                self.reasoning_parser,
                self.tokenizer,
            )
            for p in params_list
        ]
        prompts, texts = [], []
        for conversation in conversations:
            prompts.append(
                self.tokenizer.apply_chat_template(
                    conversation, add_generation_prompt, chat_template, tools=tools
                )
            )
            texts.append(
                self.tokenizer.render_chat(conversation, add_generation_prompt, chat_template, tools=tools)
            )
        outputs = self.generate(
            prompts, [p.params for p in plans], use_tqdm=use_tqdm, lora_request=lora_request
        )
        for out, text, plan in zip(outputs, texts, plans, strict=True):
            out.prompt = text
            if plan.tool_parser is not None or plan.reasoning_parser is not None:
                for seq in out.outputs:
                    split_output(seq, plan)
        return outputs

    def _ensure_lora(self, request: LoRARequest | None) -> str | None:
        """The adapter's name, loading it first if this engine does not hold that adapter (same
        name, id and path) yet."""
        if request is None:
            return None
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest or None, got {type(request).__name__}")
        held = {a.name: a for a in self.engine.list_loras()}.get(request.lora_name)
        if held is None or held.int_id != request.lora_int_id or held.path != str(request.lora_path):
            self.engine.add_lora(request.lora_name, str(request.lora_path), request.lora_int_id)
        return request.lora_name

    def _start(self, prompt, params: SamplingParams, priority: int, lora: str | None = None) -> _Track:
        text = None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(
                    "string prompts need a tokenizer; pass token ids or a model dir with tokenizer.json"
                )
            text, prompt = prompt, self.tokenizer.encode(prompt)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; use stop_token_ids instead")
        request_id = str(next(self._ids))
        self.engine.add_request(request_id, list(prompt), params, priority=priority, lora=lora)
        return _Track(request_id, list(prompt), text, params, self.tokenizer)


@dataclass
class _Seq:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list | None = None
    text_stream: object = None  # tokenizer_svc.text_stream.TextStream, when there is a tokenizer
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0


class _Track:
    """One request's text side: per sequence, the same text pipeline the gateway streams with."""

    def __init__(
        self,
        request_id: str,
        prompt_ids: list[int],
        prompt_text: str | None,
        params: SamplingParams,
        tokenizer,
    ):
        self.request_id, self.prompt_ids, self.prompt_text = request_id, prompt_ids, prompt_text
        self.params, self.tokenizer = params, tokenizer
        self.seqs = [self._new_seq() for _ in range(params.n)]
        self.num_cached_tokens = 0
        self.prompt_logprobs = None
        self.finished = False

    def _new_seq(self) -> _Seq:
        seq = _Seq()
        if self.tokenizer is not None:
            from tokenizer_svc.text_stream import TextStream

            p = self.params
            seq.text_stream = TextStream(
                self.tokenizer, self.prompt_ids, p.skip_special_tokens, p.stop, p.include_stop_str_in_output
            )
        return seq

    def consume(self, delta: RequestDelta, engine: LLMEngine) -> None:
        seq = self.seqs[delta.index]
        self.num_cached_tokens = delta.num_cached_tokens
        self.finished = delta.request_finished or engine.request_finished(self.request_id)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if seq.finish_reason is not None:
            return  # a stop string ended it; the engine's abort came after this step
        seq.num_draft_tokens = delta.num_draft_tokens  # the sequence's totals so far
        seq.num_accepted_draft_tokens = delta.num_accepted_draft_tokens
        seq.token_ids.extend(delta.new_token_ids)
        if delta.logprobs:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.extend(delta.logprobs)
        if seq.text_stream is not None:
            stopped = delta.finished and delta.stop_token_id is not None
            step = seq.text_stream.push(delta.new_token_ids, last=delta.finished, stop_token=stopped)
            seq.text += step.text
            if step.stop_string is not None:
                seq.finish_reason, seq.stop_reason = "stop", step.stop_string
                if not delta.finished:
                    engine.abort_request(self.request_id, index=delta.index)
                    self.finished = engine.request_finished(self.request_id)
                return
        if delta.finished:
            seq.finish_reason, seq.stop_reason = str(delta.finish_reason), delta.stop_token_id

    def result(self) -> RequestOutput:
        outputs = [
            CompletionOutput(
                i,
                s.token_ids,
                s.text,
                s.finish_reason or "abort",
                s.stop_reason,
                s.logprobs,
                s.num_draft_tokens,
                s.num_accepted_draft_tokens,
            )
            for i, s in enumerate(self.seqs)
        ]
        return RequestOutput(
            self.request_id,
            self.prompt_ids,
            outputs,
            self.num_cached_tokens,
            self.prompt_text,
            self.prompt_logprobs,
        )


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    elif prompts and all(isinstance(t, int) for t in prompts):
        prompts = [prompts]  # one prompt of token ids
    out = []
    for p in prompts:
        if isinstance(p, dict):
            p = p.get("prompt_token_ids", p.get("prompt"))
        if not isinstance(p, (str, list, tuple)):
            raise ValueError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
        out.append(p if isinstance(p, str) else list(p))
    return out
