"""What one step computes, as plain data: the scheduler's output, the only thing the model runner
(and every tensor-parallel rank) reads.

Ids, token ids, block ids and counts, nothing live: a sequence is named by its ``seq_id``. What the
runner sees of a sequence arrives once, the first step it appears in (``NewRequestData``: its tokens
so far, its sampling parameters, its block tables), and afterwards as per-step deltas
(``CachedRequestData``: the tokens appended since, its counter; ``updates``: its table entries that
changed); ``released`` names the sequences that hold no block any more (the runner forgets them).
The runner keeps its own state per seq id from these (``runner_state.RunnerState``), as vLLM v1's
model runner keeps its ``CachedRequestState``.

The output crosses a process boundary as a fixed int64 layout (``to_wire`` / ``from_wire``; a new
request's sampling parameters as engine.v1 ``SamplingParams`` bytes inside it): tensor parallelism
sends this one form to every rank, which builds its forward's inputs from it as rank 0 does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from engine_svc.kv_cache_manager import BlockUpdate
from engine_svc.sampling_params import SamplingParams

NO_COPIES = np.zeros((0, 2), dtype=np.int64)  # a step with no copy-on-write copies to run


@dataclass
class NewRequestData:
    """A sequence the runner has not seen (admitted, re-admitted after a preemption, or forked):
    sent once, in the first step it appears in."""

    seq_id: int
    request_id: str
    index: int  # its place among its request's n sequences (a seeded row's noise reads it)
    token_ids: list[int]  # its prompt and the outputs it has so far
    num_prompt_tokens: int
    num_computed_tokens: int
    length_limit: int  # prompt + max_tokens: no draft goes past it
    params: SamplingParams
    block_ids: list[list[int]]  # its whole block table, per KV cache group
    lora: int = 0  # the version of the LoRA adapter it runs under (``LoRAAdapter.version``); 0: none
    # its tenant (a hash of its cache salt, 0: none): a proposer drafts from the outputs of earlier
    # sequences only within one tenant, as the prefix cache shares blocks only within one
    salt: int = 0


class CachedRequestData:
    """Per scheduled sequence the runner already holds: what changed since it last heard of it.

    In the steady state - every sequence decoded last step and is scheduled again, in the same
    order - each sequence's delta is the one token it sampled: then ``one_each`` holds those tokens
    flat (one per sequence, in order) and ``new_token_ids`` is made from it only when something
    reads it (the wire, a test); the runner reads ``one_each``. Either form is the same data
    (``==`` compares the tokens, not the form)."""

    __slots__ = ("seq_ids", "_new_token_ids", "num_computed_tokens", "one_each")

    def __init__(
        self,
        seq_ids: list[int] | None = None,
        new_token_ids: list[list[int]] | None = None,  # appended since (sampled, forked)
        num_computed_tokens: list[int] | None = None,
        one_each: list[int] | None = None,  # the steady state's deltas, flat: one token each
    ):
        self.seq_ids = [] if seq_ids is None else seq_ids
        self.num_computed_tokens = [] if num_computed_tokens is None else num_computed_tokens
        self.one_each = one_each
        if new_token_ids is None and one_each is None:
            new_token_ids = []
        self._new_token_ids = new_token_ids

    @property
    def new_token_ids(self) -> list[list[int]]:
        if self._new_token_ids is None:
            self._new_token_ids = [[t] for t in self.one_each]
        return self._new_token_ids

    def __eq__(self, other) -> bool:
        if not isinstance(other, CachedRequestData):
            return NotImplemented
        return (self.seq_ids, self.new_token_ids, self.num_computed_tokens) == (
            other.seq_ids,
            other.new_token_ids,
            other.num_computed_tokens,
        )

    __hash__ = None

    def __repr__(self) -> str:
        return (
            f"CachedRequestData(seq_ids={self.seq_ids!r}, new_token_ids={self.new_token_ids!r}, "
            f"num_computed_tokens={self.num_computed_tokens!r})"
        )


@dataclass
class PromptRows:
    """Rows ``row .. row + count`` of the logits: the prompt logprobs of tokens ``first + 1 ..
    first + count`` of sequence ``seq_id`` (``logits_layout.PromptChunk`` by id)."""

    seq_id: int
    first: int
    count: int
    row: int


@dataclass
class StepRows:
    """The step's ``logits_layout.LogitsLayout`` by seq id: what each logits row is for."""

    token_rows: np.ndarray  # per logits row: its token's index in the step's flat batch
    sampled: list[int]  # seq ids that sample, in row order
    fans: list[int]  # rows per sampled sequence
    num_sample_rows: int
    prompt_chunks: list[PromptRows] = field(default_factory=list)
    drafts: list[list[int] | None] | None = None  # per sampled sequence: the drafts it verifies


@dataclass
class SchedulerOutput:
    seq_ids: list[int] = field(default_factory=list)  # scheduled, in batch order
    num_scheduled: list[int] = field(default_factory=list)  # tokens each computes this step
    new: list[NewRequestData] = field(default_factory=list)
    cached: CachedRequestData = field(default_factory=CachedRequestData)
    # Every scheduled sequence computes only its last token and samples (no prompt chunk, no fork,
    # no draft): the runner builds its inputs on a short path.
    only_decodes: bool = True
    rows: StepRows | None = None
    drafts: dict[int, list[int]] = field(default_factory=dict)  # seq id -> the drafts it verifies
    propose: dict[int, int] = field(default_factory=dict)  # seq id -> at most this many drafts after
    # The KV cache's changes since the last step, of sequences the runner held before this step.
    updates: list[BlockUpdate] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # seq ids: the runner forgets them
    copies: np.ndarray = field(default_factory=lambda: NO_COPIES)  # [C, 2] (src, dst) before the forward
    # Moves between the pool and the lower tiers (kv_tiers/transfer.py), in order, before the
    # forward (never with tensor parallelism: tiers are refused there).
    tier_ops: list | None = None
    forks: list[tuple[int, int]] = field(default_factory=list)  # (parent, child) seq ids since the last step
    finished_requests: list[str] = field(default_factory=list)  # request ids that ended since the last step
    # Structured output: the sample rows with a grammar and their allowed-token bitmasks [rows, words]
    # (int32, bit b of word w: token 32w + b), filled from each grammar's state when planned.
    grammar_rows: list[int] = field(default_factory=list)
    grammar_bitmask: np.ndarray | None = None

    # --- the wire: one int64 array --------------------------------------------------------------
    def to_wire(self) -> np.ndarray:
        """This output as one int64 array (``from_wire`` reads it back); no pickle."""
        if self.tier_ops:
            raise ValueError("a step with KV tier moves does not cross processes (tiers run in one)")
        w = _Writer()
        w.ints(self.seq_ids)
        w.ints(self.num_scheduled)
        w.int(len(self.new))
        for r in self.new:
            w.int(r.seq_id)
            w.text(r.request_id)
            w.int(r.index)
            w.ints(r.token_ids)
            w.int(r.num_prompt_tokens)
            w.int(r.num_computed_tokens)
            w.int(r.length_limit)
            w.params(r.params)
            w.int(len(r.block_ids))
            for ids in r.block_ids:
                w.ints(ids)
            w.int(r.lora)
            w.int(r.salt)
        c = self.cached
        w.ints(c.seq_ids)
        w.ints(c.num_computed_tokens)
        w.ints([len(t) for t in c.new_token_ids])
        w.ints([t for ts in c.new_token_ids for t in ts])
        w.int(int(self.only_decodes))
        w.int(self.rows is not None)
        if self.rows is not None:
            rows = self.rows
            w.ints(rows.token_rows)
            w.ints(rows.sampled)
            w.ints(rows.fans)
            w.int(rows.num_sample_rows)
            w.ints([v for p in rows.prompt_chunks for v in (p.seq_id, p.first, p.count, p.row)])
            w.int(rows.drafts is not None)
            if rows.drafts is not None:
                w.ints([-1 if d is None else len(d) for d in rows.drafts])
                w.ints([t for d in rows.drafts if d for t in d])
        w.ints(list(self.drafts))
        w.ints([len(d) for d in self.drafts.values()])
        w.ints([t for d in self.drafts.values() for t in d])
        w.ints([v for kv in self.propose.items() for v in kv])
        w.int(len(self.updates))
        for u in self.updates:
            w.int(u.seq_id)
            w.int(u.first)
            w.int(u.group)
            w.ints(u.block_ids)
        w.ints(self.released)
        w.ints(self.copies.reshape(-1))
        w.ints([v for f in self.forks for v in f])
        w.int(len(self.finished_requests))
        for rid in self.finished_requests:
            w.text(rid)
        w.ints(self.grammar_rows)
        mask = self.grammar_bitmask
        w.int(-1 if mask is None else mask.shape[1])
        if mask is not None:
            w.ints(mask.reshape(-1))
        return w.array()

    @classmethod
    def from_wire(cls, data: np.ndarray) -> SchedulerOutput:
        r = _Reader(data)
        out = cls(seq_ids=r.ints(), num_scheduled=r.ints())
        for _ in range(r.int()):
            out.new.append(
                NewRequestData(
                    seq_id=r.int(),
                    request_id=r.text(),
                    index=r.int(),
                    token_ids=r.ints(),
                    num_prompt_tokens=r.int(),
                    num_computed_tokens=r.int(),
                    length_limit=r.int(),
                    params=r.params(),
                    block_ids=[r.ints() for _ in range(r.int())],
                    lora=r.int(),
                    salt=r.int(),
                )
            )
        ids, computed, counts, flat = r.ints(), r.ints(), r.ints(), r.ints()
        out.cached = CachedRequestData(ids, _split(flat, counts), computed)
        out.only_decodes = bool(r.int())
        if r.int():
            token_rows = r.array()
            sampled, fans, num_sample_rows, chunks = r.ints(), r.ints(), r.int(), r.ints()
            drafts = None
            if r.int():
                lengths, flat = r.ints(), r.ints()
                parts = iter(_split(flat, [n for n in lengths if n >= 0]))
                drafts = [None if n < 0 else next(parts) for n in lengths]
            out.rows = StepRows(
                token_rows,
                sampled,
                fans,
                num_sample_rows,
                [PromptRows(*chunks[i : i + 4]) for i in range(0, len(chunks), 4)],
                drafts,
            )
        keys, lengths, flat = r.ints(), r.ints(), r.ints()
        out.drafts = dict(zip(keys, _split(flat, lengths), strict=True))
        pairs = r.ints()
        out.propose = dict(zip(pairs[::2], pairs[1::2], strict=True))
        for _ in range(r.int()):
            seq_id, first, group = r.int(), r.int(), r.int()
            out.updates.append(BlockUpdate(seq_id, first, r.ints(), group))
        out.released.extend(r.ints())
        out.copies = r.array().reshape(-1, 2)
        forks = r.ints()
        out.forks = list(zip(forks[::2], forks[1::2], strict=True))
        out.finished_requests = [r.text() for _ in range(r.int())]
        out.grammar_rows = r.ints()
        words = r.int()
        if words >= 0:
            out.grammar_bitmask = r.array().astype(np.int32).reshape(-1, words)
        r.done()
        return out


def _split(flat: list[int], counts: list[int]) -> list[list[int]]:
    out, at = [], 0
    for n in counts:
        out.append(flat[at : at + n])
        at += n
    return out


class _Writer:
    """Length-prefixed int64 fields; text and parameters as their bytes, 8 to a word."""

    def __init__(self) -> None:
        self.parts: list[np.ndarray] = []
        self.scalars: list[int] = []

    def _flush(self) -> None:
        if self.scalars:
            self.parts.append(np.array(self.scalars, dtype=np.int64))
            self.scalars = []

    def int(self, v: int) -> None:
        self.scalars.append(int(v))

    def ints(self, values) -> None:
        self.int(len(values))
        self._flush()
        self.parts.append(np.asarray(values, dtype=np.int64).reshape(-1))

    def bytes(self, data: bytes) -> None:
        self.int(len(data))
        padded = data + b"\0" * (-len(data) % 8)
        self._flush()
        self.parts.append(np.frombuffer(padded, dtype="<i8").astype(np.int64))

    def text(self, s: str) -> None:
        self.bytes(s.encode())

    def params(self, p: SamplingParams) -> None:
        from engine_svc.rpc.convert import sampling_params_to_proto

        self.bytes(sampling_params_to_proto(p).SerializeToString())
        self.ints(list(p.eos_token_ids))

    def array(self) -> np.ndarray:
        self._flush()
        return np.concatenate(self.parts) if self.parts else np.zeros(0, np.int64)


class _Reader:
    def __init__(self, data: np.ndarray) -> None:
        self.data = np.asarray(data, dtype=np.int64)
        self.at = 0

    def int(self) -> int:
        v = int(self.data[self.at])
        self.at += 1
        return v

    def array(self) -> np.ndarray:
        n = self.int()
        out = self.data[self.at : self.at + n]
        self.at += n
        return out

    def ints(self) -> list[int]:
        return self.array().tolist()

    def bytes(self) -> bytes:
        n = self.int()
        words = -(-n // 8)
        raw = self.data[self.at : self.at + words].astype("<i8").tobytes()[:n]
        self.at += words
        return raw

    def text(self) -> str:
        return self.bytes().decode()

    def params(self) -> SamplingParams:
        from engine_svc.rpc.convert import sampling_params_from_proto
        from llmserve_proto.engine.v1 import engine_pb2 as pb

        msg = pb.SamplingParams()
        msg.ParseFromString(self.bytes())
        params = sampling_params_from_proto(msg)
        params.eos_token_ids = tuple(self.ints())
        return params

    def done(self) -> None:
        if self.at != len(self.data):
            raise ValueError(f"scheduler output wire: {len(self.data) - self.at} words left unread")
