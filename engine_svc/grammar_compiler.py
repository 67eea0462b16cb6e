"""Grammars compiled against the model's vocabulary, off the engine loop.

``submit(grammar)`` returns a future of a fresh ``llguidance.LLMatcher``. The work (parsing the
grammar, building its lexer, computing the first token mask, which is where llguidance does most of
its lazy work) runs on a worker thread; the request waits in the queue until its matcher is ready
and holds back nobody. A warmed matcher per grammar is kept (LRU, bounded), so a second request
with the same spec pays only a ``deep_copy``. Parser limits bound the work a pathological regex or
grammar can cause.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)
MAX_CACHED_GRAMMARS = 128


class GrammarCompiler:
    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_ids: list[int], workers: int = 1):
        import llguidance

        self._llg = llguidance
        self.tokenizer = llguidance.LLTokenizer(
            str(tokenizer_json), n_vocab=vocab_size, eos_token=eos_token_ids
        )
        self.vocab_size = vocab_size
        self._limits = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.executor = llguidance.LLExecutor()  # fills the masks of a step's rows in parallel
        self.num_compiled = 0
        self.compile_s: list[float] = []  # per compile, for the benchmark

    def submit(self, grammar: str) -> Future:
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
                done: Future = Future()
                done.set_result(template.deep_copy())
                return done
        return self._pool.submit(self._compile, grammar)

    def _compile(self, grammar: str):
        import llguidance.torch as lt

        t0 = time.perf_counter()
        matcher = self._llg.LLMatcher(self.tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile for this vocabulary: {matcher.get_error()}")
        lt.fill_next_token_bitmask(matcher, lt.allocate_token_bitmask(1, self.vocab_size), 0)
        if matcher.is_error():
            raise ValueError(f"the grammar allows no token of this vocabulary: {matcher.get_error()}")
        self.compile_s.append(time.perf_counter() - t0)
        self.num_compiled += 1
        with self._lock:
            self._templates[grammar] = matcher
            while len(self._templates) > MAX_CACHED_GRAMMARS:
                self._templates.popitem(last=False)
        return matcher.deep_copy()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def find_tokenizer_json(model_dir: str | Path) -> Path | None:
    path = Path(model_dir) / "tokenizer.json"
    return path if path.exists() else None
