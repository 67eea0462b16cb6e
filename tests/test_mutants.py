"""Tests that can fail: each known mutant of a core mechanism must make the fast differential
checks fail.

A mutant is a one-line change to the source of one real function (applied in-process to a copy of
that function, so nothing on disk changes). For each, the fast checks — the batch-invariance
regressions and a few derandomized random mixes against their solo runs, or for a mutant outside
the engine's core the one fast test named with it — run with the mutant in place and must fail (a
wrong result or a crash); unmutated they pass (the rest of the suite). The mutants:
"""

from __future__ import annotations

import inspect
import textwrap

import pytest

from benchmarks import compute_efficiency, step_overhead
from engine_svc.block_pool import BlockPool
from engine_svc.kv_cache_manager import KVCacheManager
from engine_svc.logits_layout import LogitsLayout
from engine_svc.logits_processors import bad_words
from engine_svc.sampler import Sampler
from engine_svc.sampling_params import SamplingParams
from engine_svc.scheduler import Scheduler
from gateway import openai_protocol
from kernels.cpu import greedy_head, native_attention, native_build
from tests import test_batch_invariance as mixes
from tests import test_batch_invariance_regressions as regressions
from tests import (
    test_bench_quick,
    test_greedy_head,
    test_logit_controls,
    test_openai_protocol,
    test_request_limits,
    test_speculative,
    test_step_contract,
    test_structured_outputs,
)


def _module(module):
    """A module-level function as a mutant's owner (``setattr`` on the module)."""
    return module


def _model_free(test):
    """A fast check that takes no model (named at import, so a typo fails loudly, not as a catch)."""
    return lambda model_dir: test()


speculation_checks = _model_free(test_speculative.test_a_sequence_whose_drafts_fail_stops_drafting)
bad_word_checks = test_logit_controls.test_a_bad_words_last_token_stays_allowed_after_any_other_token
stop_string_checks = _model_free(
    lambda: test_openai_protocol.test_stop_as_a_string_or_a_list_reaches_the_request("END", ["END"])
)
step_overhead_checks = test_bench_quick.test_step_overhead_recovers_each_known_cost
logit_control_checks = test_structured_outputs.test_logit_bias_allowed_ids_and_bad_words
greedy_head_checks = _model_free(
    lambda: test_greedy_head.ties_and_nans_across_slices(native_build.chosen_isa())
)
efficiency_timing_checks = (
    test_bench_quick.test_compute_efficiency_counts_known_flops_and_times_a_model_of_known_cost
)
efficiency_judging_checks = _model_free(
    test_bench_quick.test_compute_efficiency_judges_known_figures_against_the_fastest_gemm
)
request_rule_checks = _model_free(test_request_limits.test_every_rule_at_its_boundaries)
recompute_checks = regressions.test_logprobs_are_bitwise_after_a_preemption_mid_decode


def on_the_python_loop(check):
    """``check`` with the decoder's Python layer loop (the native loop never calls the kernel
    wrappers' choices that a mutant there changes)."""

    def run(model_dir):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("LLMSERVE_NATIVE_DECODER_LOOP", "0")
            check(model_dir)

    return run


lookahead_checks = _model_free(
    test_step_contract.test_a_draft_models_lookahead_is_allocated_with_the_step_and_released_when_rejected
)


# (name, owner, function, the original text, the mutant's text[, the fast check that must fail])
MUTANTS = [
    ("copy-on-write switched off", KVCacheManager, "allocate", "cow = (", "cow = False and ("),
    (
        "a prefix hit's token ids not checked",
        BlockPool,
        "lookup",
        "if block_id is None or self.blocks[block_id].token_ids != token_ids:",
        "if block_id is None:",
    ),
    (
        "a block hash not chained to its parent (nor to the tenant's salt)",
        KVCacheManager,
        "block_hashes",
        "parent = chain_hash(parent, tokens[i * bs : (i + 1) * bs])",
        "parent = chain_hash(0, tokens[i * bs : (i + 1) * bs])",
    ),
    (
        "off by one in num_computed_tokens after a chunk",
        Scheduler,
        "update_from_output",
        "seq.num_computed_tokens + n",
        "seq.num_computed_tokens + n + (n > 1)",
    ),
    (
        "preemption keeps the counter of the blocks it released",
        Scheduler,
        "_release",
        "seq.num_computed_tokens = 0",
        "pass",
    ),
    (
        "a new block id dropped from the scheduler output",
        KVCacheManager,
        "take_step_changes",
        "updates.append(BlockUpdate(seq.seq_id, first, table[first:], g))",
        "updates.append(BlockUpdate(seq.seq_id, first, table[first:-1] if len(table) > 1"
        " else table[first:], g))",
    ),
    (
        "a released table not carried to the input batch",
        KVCacheManager,
        "take_step_changes",
        "released.append(seq.seq_id)",
        "pass",
    ),
    (
        "logits rows: prompt-logprob rows before the sample rows",
        LogitsLayout,
        "build",
        "np.array(sample_rows + plp_rows",
        "np.array(plp_rows + sample_rows",
    ),
    (
        "aborting one output before the fork ends the whole request",
        Scheduler,
        "abort",
        "elif request.finished:",
        "else:",
    ),
    (
        "a prefix hit served to a request that wants prompt logprobs",
        KVCacheManager,
        "find_cached_prefix",
        "if not self.enable_prefix_caching or seq.request.params.prompt_logprobs is not None:",
        "if not self.enable_prefix_caching:",
    ),
    (
        "prompt logprobs sent again after the first delta",
        Scheduler,
        "update_from_output",
        "request.prompt_logprobs_sent = True",
        "pass",
    ),
    (
        "speculation keeps a rejected draft's lookahead blocks until the sequence ends",
        Scheduler,
        "_keep_drafts",
        "kv.trim(seq, len(seq.spec_token_ids) if lookahead else 0)",
        "pass",
        speculation_checks,
    ),
    (
        "the drafts the runner returns in the step result are dropped by the update",
        Scheduler,
        "_keep_drafts",
        "draft = proposed.get(seq.seq_id) or []",
        "draft = []",
        speculation_checks,
    ),
    (
        "a draft model's lookahead kept after its drafts were rejected",
        Scheduler,
        "_keep_drafts",
        "kv.trim(seq, len(seq.spec_token_ids) if lookahead else 0)",
        "kv.trim(seq, lookahead)",
        lookahead_checks,
    ),
    (
        "the drafts a sequence holds are never scheduled for verification",
        Scheduler,
        "_speculate",
        "draft = seq.spec_token_ids[:k] if seq.spec_token_ids and k > 0 else None",
        "draft = None",
        speculation_checks,
    ),
    (
        "a bad word's last token banned without its earlier tokens preceding it",
        _module(bad_words),
        "last_tokens_banned_now",
        "if k == 0 or (len(output) >= k and output[len(output) - k :] == word[:-1]):",
        "if True:",
        bad_word_checks,
    ),
    (
        "the OpenAI stop given as one string dropped",
        _module(openai_protocol),
        "common_request",
        "req.stop.append(stop)",
        "pass",
        stop_string_checks,
    ),
    (
        "the step-overhead benchmark keeps only the last sampler call's time",
        step_overhead.TimedSampler,
        "__call__",
        "self.inside_s += time.perf_counter() - t0",
        "self.inside_s = time.perf_counter() - t0",
        step_overhead_checks,
    ),
    (
        "the step-overhead benchmark counts the stub model's time as overhead",
        _module(step_overhead),
        "measure",
        "overhead = wall - stub.inside_s - sampler.inside_s",
        "overhead = wall - sampler.inside_s",
        step_overhead_checks,
    ),
    (
        "the compute-efficiency benchmark keeps only the LM head's last time",
        compute_efficiency.TimedModel,
        "compute_logits",
        "self.inside_s += time.perf_counter() - t0",
        "self.inside_s = time.perf_counter() - t0",
        efficiency_timing_checks,
    ),
    (
        "the compute-efficiency benchmark judges against the slowest GEMM",
        _module(compute_efficiency),
        "judge",
        "max(rates, key=rates.get)",
        "min(rates, key=rates.get)",
        efficiency_judging_checks,
    ),
    (
        "the sampler skips the logits processors' constraints (bias, allowed ids, grammar)",
        Sampler,
        "__call__",
        "if processor.constraint:",
        "if processor.constraint and processor.flag < 0:",
        logit_control_checks,
    ),
    (
        "the shared request rules let top_p = 0 through (a range check dropped)",
        SamplingParams,
        "violations",
        'lambda x: 0 < x <= 1, "in (0, 1]"',
        'lambda x: x <= 1, "in (0, 1]"',
        request_rule_checks,
    ),
    (
        # What a recompute after preemption met before decodes and chunk rows attended in one order:
        # logprobs ~1e-6 off the solo run's, inside any tolerance, caught only bit for bit.
        "steps of more than one token attend in another summation order than decodes (the torch path)",
        _module(native_attention),
        "takes",
        "and q.shape[1] % k_cache.shape[2] == 0",
        "and q.shape[1] % k_cache.shape[2] == 0 and q.shape[0] == 1",
        on_the_python_loop(recompute_checks),
    ),
    (
        "the greedy head's slices merged keeping the last of equal maxima",
        greedy_head.ChunkedArgmax,
        "__call__",
        "take = ~nan_seen & (v_nan | (v > best_v))",
        "take = ~nan_seen & (v_nan | (v >= best_v))",
        greedy_head_checks,
    ),
]
__doc__ += "".join(f"\n- {m[0]}" for m in MUTANTS)


def mutated(owner, name: str, old: str, new: str):
    """A copy of ``owner.name`` compiled from its source with ``old`` replaced by ``new``."""
    func = inspect.unwrap(getattr(owner, name))
    func = getattr(func, "__func__", func)
    source = textwrap.dedent(inspect.getsource(func))
    assert source.count(old) == 1, f"the mutant's target text is not (once) in {owner.__name__}.{name}"
    namespace = dict(func.__globals__)
    exec(compile(source.replace(old, new), inspect.getsourcefile(func), "exec"), namespace)
    replacement = namespace[name]
    return (
        classmethod(replacement)
        if isinstance(inspect.getattr_static(owner, name), classmethod)
        else replacement
    )


def fast_checks(model_dir) -> None:
    for name in dir(regressions):
        if name.startswith("test_"):
            getattr(regressions, name)(model_dir)
    mixes.test_random_mixes_equal_their_solo_runs(model_dir)  # 8 examples (test_mutant_is_caught)


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m[0] for m in MUTANTS])
def test_mutant_is_caught(tiny_llama, monkeypatch, mutant):
    _, owner, name, old, new, *check = mutant
    monkeypatch.setattr(owner, name, mutated(owner, name, old, new))
    monkeypatch.setattr(mixes, "EXAMPLES", 8)  # not left behind for the mixes' own tests
    with pytest.raises(Exception):  # noqa: B017 - a wrong result or a crash: either way it is caught
        (check[0] if check else fast_checks)(tiny_llama)
