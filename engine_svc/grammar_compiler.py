"""Grammars compiled against the model's vocabulary, off the engine loop.

``submit(grammar)`` returns a future of a fresh ``llguidance.LLMatcher``. The work (parsing the
grammar, building its lexer, computing the first token mask, which is where llguidance does most of
its lazy work) runs on a worker thread; the request waits in the queue until its matcher is ready
and holds back nobody. The future of a warmed matcher per grammar is kept (LRU, bounded), so a
second request with the same spec, even one that arrives while the first compile runs, pays only a
``deep_copy``. Parser limits bound the work a pathological regex or
grammar can cause.

The vocabulary's tables (``llguidance.LLTokenizer``: 150 MiB for Qwen2.5's 151,936 tokens, 461 MiB
for Gemma 3's 262,144) are built by the first compile, on the worker thread, as vLLM builds its
grammar backend on the first structured request: a server that never sees one never holds them,
and the first one waits for them (about a second) in the queue, holding back nobody.
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
        self._tokenizer_args = (str(tokenizer_json), vocab_size, eos_token_ids)
        self._tokenizer = None  # built by the first compile (the module's text)
        self.vocab_size = vocab_size
        self._limits = llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000)
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._templates: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._vocab_lock = threading.Lock()
        self.executor = llguidance.LLExecutor()  # fills the masks of a step's rows in parallel
        self.num_compiled = 0
        self.compile_s: list[float] = []  # per compile, for the benchmark

    def submit(self, grammar: str) -> Future:
        """A future of a fresh matcher for ``grammar``. Requests with the same grammar share one
        compile, also while it is still running."""
        with self._lock:
            template = self._templates.get(grammar)
            if template is None:
                template = self._templates[grammar] = self._pool.submit(self._compile, grammar)
                while len(self._templates) > MAX_CACHED_GRAMMARS:
                    self._templates.popitem(last=False)
            else:
                self._templates.move_to_end(grammar)
        fresh: Future = Future()

        def copy(done: Future) -> None:
            error = done.exception()
            if error is not None:
                fresh.set_exception(error)
            else:
                fresh.set_result(done.result().deep_copy())

        template.add_done_callback(copy)
        return fresh

    @property
    def tokenizer(self):
        """The vocabulary's ``LLTokenizer``, built on first use (on the worker thread by a compile)."""
        with self._vocab_lock:  # not self._lock: submit() on the engine loop never waits for this
            if self._tokenizer is None:
                path, vocab_size, eos = self._tokenizer_args
                t0 = time.perf_counter()
                self._tokenizer = self._llg.LLTokenizer(path, n_vocab=vocab_size, eos_token=eos)
                log.info(
                    "grammar vocabulary built in %.1fs (first structured request)", time.perf_counter() - t0
                )
            return self._tokenizer

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
        return matcher  # the template: never stepped, only copied

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def find_tokenizer_json(model: str | Path) -> Path | None:
    from tokenizer_svc.tokenizer_files import find_tokenizer_dir

    d = find_tokenizer_dir(model)
    return None if d is None else d / "tokenizer.json"
