"""Once per step: decide how many tokens each sequence computes, under a global token budget.

Running sequences are served first (so streams that already decode are never starved by a long
prompt), then waiting ones are admitted. A prompt longer than the remaining budget is cut into
chunks (chunked prefill). When the pool runs dry, the most recently admitted running sequence (or
the lowest-priority one) is preempted: its blocks are released and it goes back to the front of the
waiting queue, to be recomputed later (cheaply, from the prefix cache).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine_svc.config import EngineConfig
from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.sequence import SeqStatus, Sequence


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)  # scheduled, in batch order
    num_new: list[int] = field(default_factory=list)  # tokens each computes this step
    preempted: list[Sequence] = field(default_factory=list)
    # Every scheduled sequence computes only its last token and has sampled before (so no prompt
    # chunk, no fork due): the model runner and the engine take their short path.
    only_decodes: bool = True

    @property
    def scheduled(self) -> list[tuple[Sequence, int]]:
        return list(zip(self.seqs, self.num_new, strict=True))

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new.append(n)

    def unschedule(self, seq: Sequence) -> int:
        for j, s in enumerate(self.seqs):
            if s is seq:
                del self.seqs[j]
                return self.num_new.pop(j)
        return 0


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager):
        self.config = config
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.priority = config.scheduling_policy == "priority"

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        if self.priority:
            self._insert_by_priority(seq)
        else:
            self.waiting.append(seq)

    def _insert_by_priority(self, seq: Sequence) -> None:
        key = _priority_key(seq)
        for i, other in enumerate(self.waiting):
            if key < _priority_key(other):
                self.waiting.insert(i, seq)
                return
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out of whichever queue holds it and release its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        # The loop below runs once per running sequence per step: locals, not attribute lookups.
        running, allocate = self.running, self.kv.allocate
        add_seq, add_num = out.seqs.append, out.num_new.append
        while i < len(running) and budget > 0:
            seq = running[i]
            num_tokens = len(seq.token_ids)
            remaining = num_tokens - seq.num_computed_tokens
            num_new = remaining if remaining < budget else budget
            if remaining != 1 or num_tokens == seq.request.num_prompt_tokens:
                out.only_decodes = False
            while not allocate(seq, num_new):
                victim = self._pick_victim()
                if self.running.index(victim) < i:  # (priority policy) already served this step
                    budget += out.unschedule(victim)
                    i -= 1
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                add_seq(seq)
                add_num(num_new)
                budget -= num_new
                i += 1
        if out.preempted:
            return out  # the pool is under pressure: admit nobody new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self.kv.find_cached_prefix(seq)
            remaining = seq.num_tokens - len(cached) * self.kv.block_size
            if not self.config.enable_chunked_prefill and remaining > budget:
                break
            num_new = min(remaining, budget)
            if not self.kv.allocate(seq, num_new, cached):
                victim = self._lower_priority_victim(seq)
                if victim is None:
                    break
                budget += out.unschedule(victim)
                self._preempt(victim, out)
                continue  # the pool changed: look up the prefix again
            self.waiting.popleft()
            self.kv.note_admission(seq, len(cached))
            if not seq.admitted_before:
                seq.num_cached_tokens = len(cached) * self.kv.block_size
                seq.admitted_before = True
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            out.add(seq, num_new)
            out.only_decodes = False
            budget -= num_new
        return out

    def _lower_priority_victim(self, seq: Sequence) -> Sequence | None:
        """Priority policy: the running sequence that a waiting ``seq`` may evict, if any."""
        if not self.priority or not self.running:
            return None
        victim = max(self.running, key=_priority_key)
        return victim if _priority_key(victim) > _priority_key(seq) else None

    def _pick_victim(self) -> Sequence:
        if self.priority:
            return max(self.running, key=_priority_key)
        return self.running[-1]

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        self.num_preemptions += 1
        out.preempted.append(seq)
        if self.priority:
            self._insert_by_priority(seq)
        else:
            self.waiting.appendleft(seq)


def _priority_key(seq: Sequence) -> tuple[int, int, int]:
    # Lower value = served first (vLLM's convention); ties by arrival, then by sequence index.
    return (seq.request.priority, seq.request.arrival, seq.index)
