"""Shared by the engine tests: drive an engine to completion checking the pool after every step,
and compare greedy tokens with HF transformers."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import torch

from engine_svc import EngineConfig, SamplingParams
from engine_svc.engine import LLMEngine

# Below this top-2 logit gap (in HF's own fp32 run) a different summation order may flip the argmax.
NEAR_TIE = 1e-4


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def random_model(
    out, tokenizer_dir, arch: str = "llama", *, seed: int, vocab_size: int = 1024, **config
) -> Path:
    """A random-weight HF model of ``arch`` in ``out`` (eos 2 unless ``config`` says otherwise), with
    the tokenizer files of ``tokenizer_dir``."""
    from engine_svc.models.build import build_random_model

    config.setdefault("eos_token_id", 2)
    d = build_random_model(out, arch, seed=seed, vocab_size=vocab_size, **config)
    for f in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / f, d / f)
    return d


def make_engine(model_dir, **overrides) -> LLMEngine:
    options = dict(block_size=16, num_kv_blocks=256, max_num_batched_tokens=512)
    options.update(overrides)
    return LLMEngine(EngineConfig(model=str(model_dir), **options))


def run_to_completion(
    engine: LLMEngine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    add_later: dict[str, tuple[list[int], SamplingParams]] | None = None,
    add_after_steps: int = 3,
) -> dict[tuple[str, int], list[int]]:
    """Tokens per (request id, sequence index); the pool is checked after every step and at the end."""
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    outputs: dict[tuple[str, int], list[int]] = {}
    steps = 0
    while engine.has_unfinished_requests() or add_later:
        if add_later and steps >= add_after_steps:
            for rid, (prompt, params) in add_later.items():
                engine.add_request(rid, prompt, params)
            add_later = None
        for delta in engine.step():
            outputs.setdefault((delta.request_id, delta.index), []).extend(delta.new_token_ids)
        engine.check_invariants()
        steps += 1
        assert steps < 10_000, "engine did not finish"
    assert_pool_whole(engine)
    return outputs


def assert_pool_whole(engine: LLMEngine) -> None:
    engine.check_invariants()
    stats = engine.stats()
    assert stats.kv_blocks_used == 0, f"{stats.kv_blocks_used} blocks still in use"
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert not engine.requests


def count_native_loop_runs(monkeypatch) -> list[bool]:
    """A list that records, per forward offered to the native layer loop (kernels/cpu/native_decoder.py),
    whether the loop took it (its ``run`` returned a result) or declined it to the Python loop."""
    from kernels.cpu import native_decoder

    ran: list[bool] = []
    run = native_decoder.NativeDecoderLoop.run

    def counted(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(native_decoder.NativeDecoderLoop, "run", counted)
    return ran


def random_prompts(lengths, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def hf_greedy(hf_model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """HF's greedy tokens. The attention mask is explicit: without one, generate masks every prompt
    position whose id equals the pad token (a chat model's end-of-turn id, often)."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def assert_greedy_matches(hf_model, prompt: list[int], got: list[int], ref: list[int]) -> None:
    """Equal, or diverging only where HF's own top-2 gap is an arithmetic near-tie."""
    if got == ref:
        return
    pos = (
        next(i for i, (a, b) in enumerate(zip(got, ref, strict=False)) if a != b)
        if len(got) == len(ref)
        else 0
    )
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt + ref[:pos]])).logits[0, -1]
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, (
        f"greedy tokens differ from HF at output position {pos} where HF's top-2 gap is {gap:.3g} "
        f"(a bug, not arithmetic)\n engine: {got}\n     hf: {ref}"
    )


def hf_reference_prompts(hf_model, lengths, vocab: int, max_new_tokens: int):
    """The architecture tests' prompts -- ``lengths``, then two sharing a 20-token prefix (a prefix
    hit) -- and HF's greedy tokens for each."""
    prompts = random_prompts(lengths, vocab, seed=5)
    shared = random_prompts([20], vocab, seed=6)[0]
    prompts += [shared + tail for tail in random_prompts([3, 12], vocab, seed=7)]
    return prompts, [hf_greedy(hf_model, p, max_new_tokens) for p in prompts]


def check_greedy_equals_hf(model, hf_model, prompts, refs, max_new_tokens: int, **options):
    """Every prompt's greedy tokens from one engine (``options``) equal HF's ``refs``; the engine."""
    engine = make_engine(model, **options)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    outputs = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf_model, p, outputs[(str(i), 0)], ref)
    return engine


# The engine features an architecture's declaration refuses at start until they are tested on it
# (``engine_svc.models.arch.refuse_untested``): (option, words the refusal says).
UNTESTED_FEATURES = [
    (dict(enable_lora=True), "LoRA adapters"),
    (dict(speculative_config={"method": "ngram", "num_speculative_tokens": 2}), "speculative decoding"),
    (dict(tensor_parallel_size=2), "tensor parallelism"),
]


def check_refused_at_start(model_dir, arch_name: str, option: dict, words: str) -> None:
    """Starting an engine on ``model_dir`` with ``option`` is refused, naming the feature and the
    architecture."""
    import pytest

    with pytest.raises(ValueError, match=f"{words}.*{arch_name}"):
        LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=64, **option))


def check_prefix_hits_and_preemption(model, hf_model, prompts, refs, max_new_tokens: int, *, tight_blocks=12):
    """The architecture tests' second pass: one engine run twice over ``prompts`` (the second run
    from cached prefixes: hits asserted), then a pool of ``tight_blocks`` too small for every
    request at once (preemptions asserted; None skips it); greedy = HF's ``refs`` throughout."""
    engine = check_greedy_equals_hf(
        model, hf_model, prompts, refs, max_new_tokens, block_size=8, max_num_batched_tokens=64
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    again = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert engine.stats().prefix_hit_tokens > 0
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf_model, p, again[(str(i), 0)], ref)
    if tight_blocks is not None:
        tight = check_greedy_equals_hf(
            model,
            hf_model,
            prompts,
            refs,
            max_new_tokens,
            block_size=8,
            num_kv_blocks=tight_blocks,
            max_num_batched_tokens=32,
        )
        assert tight.stats().num_preemptions > 0


def check_solo_runs(model_dir, *, required_extra=(), **explore_options) -> None:
    """Each request's result is bitwise its solo run over random mixes (a few examples: the mixes'
    machinery is tested on Llama), prompts chunked by a budget of 16; the mixes must have held
    chunked prefills, prefix hits, general steps and preemptions (and ``required_extra``)."""
    from tests.test_batch_invariance import EXAMPLES, explore

    required = ("chunked prefills", "prefix-hit tokens", "general steps", "preemptions") + tuple(
        required_extra
    )
    extra = {"speculative_config": None, "max_num_batched_tokens": 16}
    explore(model_dir, max(8, EXAMPLES // 3), extra, required, **explore_options)


def check_q8_0_blocks(model_dir, prompts, max_new_tokens: int, path) -> tuple[LLMEngine, LLMEngine]:
    """A Q8_0 GGUF of ``model_dir`` written to ``path``: served from its blocks (fp32 activations)
    and from its dequantized floats, the same greedy tokens; (blocks engine, floats engine)."""
    from tests.gguf_files import write_gguf

    write_gguf(model_dir, path, "Q8_0")
    blocks = make_engine(path, num_kv_blocks=64, quantized_activations="none")
    floats = make_engine(path, num_kv_blocks=64, quantization="none")
    assert blocks.model.layers[0].qkv_proj.fmt == "Q8_0"
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True)
    requests = {str(i): (p, params) for i, p in enumerate(prompts)}
    assert run_to_completion(blocks, requests) == run_to_completion(floats, requests)
    return blocks, floats


def check_gguf_reads_back(hf_model, gguf_path, *, skip=(), **from_pretrained) -> None:
    """transformers' own GGUF loader, an independent reader of the file, gives ``hf_model``'s
    weights back (names in ``skip`` and the rotary buffers aside)."""
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32, **from_pretrained
    ).state_dict()
    for name, tensor in hf_model.state_dict().items():
        if name not in skip and "rotary_emb" not in name:
            assert torch.equal(theirs[name], tensor), name
