"""The runner's own record of a sequence, keyed by seq id (vLLM v1's ``CachedRequestState``): made
from the step output's ``NewRequestData`` the first step the sequence appears in, advanced by each
later step's deltas (``CachedRequestData``), dropped when the output says the sequence was released.
The sampler's controls, prompt logprobs, pooling and the proposers read it; nothing on the runner's
side reads the scheduler's ``Sequence``."""

from __future__ import annotations

from dataclasses import dataclass

from engine_svc.sampling_params import SamplingParams
from engine_svc.scheduler_output import NewRequestData


@dataclass(eq=False, slots=True)
class RequestState:
    seq_id: int
    request_id: str
    index: int
    token_ids: list[int]  # the runner's own copy: prompt and outputs, as the scheduler last sent them
    num_prompt_tokens: int
    num_computed_tokens: int
    length_limit: int
    params: SamplingParams
    lora: int  # LoRA adapter version (0: none)
    salt: int = 0  # its tenant (NewRequestData.salt)

    @classmethod
    def of(cls, new: NewRequestData) -> RequestState:
        return cls(
            new.seq_id,
            new.request_id,
            new.index,
            list(new.token_ids),  # its own: the deltas extend it
            new.num_prompt_tokens,
            new.num_computed_tokens,
            new.length_limit,
            new.params,
            new.lora,
            new.salt,
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class RequestStates(dict):
    """seq id -> ``RequestState``: what the runner holds, followed from each step's output."""

    # The last steady step's seq-id list (the builder sends the same list object all through a
    # steady run) and their states, in that order.
    _steady: tuple[list[int], list[RequestState]] | None = None

    def follow(self, out) -> list[RequestState]:
        """Apply a ``SchedulerOutput``: forget the released, add the new, advance the cached.
        Returns the states of the scheduled sequences, in batch order."""
        for seq_id in out.released:
            self.pop(seq_id, None)
        for new in out.new:
            self[new.seq_id] = RequestState.of(new)
        cached = out.cached
        steady = self._steady
        if steady is not None and steady[0] is cached.seq_ids and not out.released and not out.new:
            states = steady[1]  # the same sequences as last step, held since
        else:
            states = list(map(self.__getitem__, cached.seq_ids))
        self._steady = (cached.seq_ids, states) if cached.one_each is not None else None
        if cached.one_each is not None:  # the steady state: one token each
            for state, token, computed in zip(
                states, cached.one_each, cached.num_computed_tokens, strict=True
            ):
                state.token_ids.append(token)
                state.num_computed_tokens = computed
        else:
            for state, tokens, computed in zip(
                states, cached.new_token_ids, cached.num_computed_tokens, strict=True
            ):
                state.token_ids += tokens
                state.num_computed_tokens = computed
        if cached.seq_ids is not out.seq_ids and cached.seq_ids != out.seq_ids:
            # some are new: not every state is in batch order yet
            states = list(map(self.__getitem__, out.seq_ids))
        return states
