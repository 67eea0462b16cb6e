"""benchmarks/long_context.py's engine side: what it times at a depth is the test on top of the cached
context, never a recompute of part of it. The engine is stood in for by a prefix cache of a few
blocks with least-recently-used eviction (the CPU pool holds one longest sequence: the shallower
depth's requests evicted part of a 4,096 context, and round 1's pp512 there read half round 2's rate)."""

import random
from collections import OrderedDict
from types import SimpleNamespace

from benchmarks.long_context import OursAtDepth

BLOCK = 16


class TinyCache:
    """``generate`` of one prompt: its full blocks found cached from the start (keyed by the whole
    prefix, as the block hash chain is), then all of them cached, the least recently used evicted
    past ``blocks``."""

    def __init__(self, blocks: int) -> None:
        self.blocks, self.lru = blocks, OrderedDict()
        self.log: list[tuple[int, int]] = []  # (prompt tokens, tokens found cached) per request

    def generate(self, prompts, sp, use_tqdm=False):
        (prompt,) = prompts
        keys = [tuple(prompt[: (i + 1) * BLOCK]) for i in range(len(prompt) // BLOCK)]
        hit = 0
        while hit < len(keys) and keys[hit] in self.lru:
            hit += 1
        for key in keys:
            self.lru[key] = None
            self.lru.move_to_end(key)
        while len(self.lru) > self.blocks:
            self.lru.popitem(last=False)
        self.log.append((len(prompt), hit * BLOCK))
        out = SimpleNamespace(token_ids=[0] * sp.max_tokens)
        return [SimpleNamespace(num_cached_tokens=hit * BLOCK, outputs=[out])]


def _ours(blocks: int, depths: list[int]) -> OursAtDepth:
    ours = object.__new__(OursAtDepth)  # the benchmark's logic over the stand-in engine
    ours.llm, ours.rng, ours.vocab = TinyCache(blocks), random.Random(0), 1000
    ours.n_prompt, ours.n_gen = 32, 4  # two blocks of new ids for pp, one id for tg
    ours.contexts = {d: ours._ids(d) for d in depths}
    ours.cached = []
    return ours


def test_each_timed_request_at_depth_finds_its_whole_context_cached():
    ours = _ours(blocks=5, depths=[0, 64])  # the 64-token context's 4 blocks and 1 more
    ours.prefill(64)
    for _ in range(3):  # rounds: the shallow depth's requests first, as main() runs them
        ours.run(0, 1)
        ours.llm.log.clear()
        ours.run(64, 1)
        timed = [hit for n, hit in ours.llm.log if n > 64]  # the context plus the test's new ids
        assert timed == [64, 64], f"the timed requests found {timed} of the context's 64 tokens cached"
