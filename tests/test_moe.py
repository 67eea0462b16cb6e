"""Routed experts (engine_svc/models/routed_experts.py) on the declared Qwen3-MoE and Mixtral
architectures (engine_svc/models/arch/qwen3_moe.py, mixtral.py): tiny random models from the HF
classes (fp32, 8 and 6 experts, two a token; Qwen3-MoE with a dense layer among its MoE ones,
Mixtral with a sliding window) give HF transformers' greedy tokens, batched, chunked, from cached
prefixes and through preemptions; each expert's tensors land where HF has them; a request's tokens
and logprobs are bitwise its solo run in a mix that puts other counts of tokens on its experts; a
GGUF of each (written with the ``gguf`` package, experts stacked as llama.cpp's ``ffn_*_exps``; the
Qwen3-MoE one read back by transformers' own GGUF loader) gives the same tokens, in F32 and from
each expert's Q8_0 blocks; a mutant router (no renormalisation) fails the HF comparison; what is
not built refuses naming the field or the feature."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_svc import SamplingParams
from engine_svc.models.decoder import ROUTED_EXPERTS_REASON
from engine_svc.models.routed_experts import RoutedExperts
from engine_svc.models.spec import ModelSpec
from tests.engine_helpers import (
    UNTESTED_FEATURES,
    assert_greedy_matches,
    check_greedy_equals_hf,
    check_refused_at_start,
    hf_reference_prompts,
    make_engine,
    random_model,
    run_to_completion,
)

VOCAB = 1024
MAX_NEW = 10
LENGTHS = [1, 5, 8, 9, 17, 40]
SHAPE = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2
)
MODELS = {
    # layer 1 dense (mlp_only_layers), layers 0 and 2 with 8 experts of 32, top-2 renormalised
    "qwen3_moe": dict(
        SHAPE, num_experts=8, moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True
    ),
    # 6 experts of 64 on every layer, a 16-token sliding window served on each
    "mixtral": dict(SHAPE, intermediate_size=64, num_local_experts=6, sliding_window=16),
}


@pytest.fixture(scope="module", params=list(MODELS))
def moe(request, tmp_path_factory, trained_tokenizer_dir):
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    model_dir = random_model(
        root / "hf", trained_tokenizer_dir, arch, seed=39, vocab_size=VOCAB, **MODELS[arch]
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts, refs = hf_reference_prompts(hf, LENGTHS, VOCAB, MAX_NEW)
    return arch, model_dir, hf, prompts, refs


def _check(moe, **options):
    _, model_dir, hf, prompts, refs = moe
    return check_greedy_equals_hf(model_dir, hf, prompts, refs, MAX_NEW, **options)


def test_each_experts_tensors_land_where_hf_has_them(moe):
    from engine_svc.models.decoder import DecoderForCausalLM
    from engine_svc.models.loader import load_weights

    arch, model_dir, hf, _, _ = moe
    spec = ModelSpec.from_path(model_dir)
    model = DecoderForCausalLM(spec, torch.float32, 64)
    load_weights(model, model_dir)  # the loader alone: the parameters as placed
    kinds = [layer.experts is not None for layer in model.layers]
    assert kinds == ([True, False, True] if arch == "qwen3_moe" else [True] * 3)
    for ours, theirs in zip(model.layers, hf.model.layers, strict=True):
        if ours.experts is None:
            assert torch.equal(
                ours.gate_up_weight, torch.cat([theirs.mlp.gate_proj.weight, theirs.mlp.up_proj.weight])
            )
            continue
        mlp = theirs.mlp  # transformers 5: the experts stacked, gate rows then up rows
        assert torch.equal(ours.experts.router_weight, mlp.gate.weight)
        for e in range(ours.experts.count):
            assert torch.equal(ours.experts.gate_up_weights[e], mlp.experts.gate_up_proj[e])
            assert torch.equal(ours.experts.down_weights[e], mlp.experts.down_proj[e])


def test_the_stacked_form_transformers_5_holds_loads_the_same(moe, tmp_path):
    """A checkpoint of transformers 5's in-memory names (``mlp.experts.gate_up_proj`` ``[E, 2W, h]``,
    ``mlp.experts.down_proj``, Mixtral's router as ``mlp.gate``) loads to the same parameters."""
    import shutil

    from safetensors.torch import save_file

    from engine_svc.models.decoder import DecoderForCausalLM
    from engine_svc.models.loader import load_weights

    _, model_dir, hf, _, _ = moe
    stacked = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in stacked)
    save_file(stacked, str(tmp_path / "model.safetensors"))
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    spec = ModelSpec.from_path(model_dir)
    models = [DecoderForCausalLM(spec, torch.float32, 64) for _ in range(2)]
    load_weights(models[0], model_dir)
    load_weights(models[1], tmp_path)
    for (name, a), (_, b) in zip(models[0].named_parameters(), models[1].named_parameters(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("block_size,budget", [(8, 512), (16, 7)])
def test_greedy_equals_hf_batched_and_chunked(moe, block_size, budget):
    engine = _check(moe, block_size=block_size, max_num_batched_tokens=budget)
    assert engine.model.native_loop_reason == ROUTED_EXPERTS_REASON  # the Python layer loop, by design


def test_greedy_equals_hf_with_prefix_hits_and_preemption(moe):
    _, _, hf, prompts, refs = moe
    engine = _check(moe, block_size=8, max_num_batched_tokens=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    again = run_to_completion(engine, {str(i): (p, params) for i, p in enumerate(prompts)})
    assert engine.stats().prefix_hit_tokens > 0
    for i, (p, ref) in enumerate(zip(prompts, refs, strict=True)):
        assert_greedy_matches(hf, p, again[(str(i), 0)], ref)
    tight = _check(moe, block_size=8, num_kv_blocks=12, max_num_batched_tokens=32)
    assert tight.stats().num_preemptions > 0


def test_a_router_without_renormalisation_fails_the_hf_comparison(moe, monkeypatch):
    """The mutant: the top-k weights left as the softmax gave them (Qwen3-MoE's norm_topk_prob and
    Mixtral's rule both renormalise): the comparison with HF must catch it."""
    mutant = property(lambda self: False, lambda self, value: None)
    monkeypatch.setattr(RoutedExperts, "renormalize", mutant, raising=False)
    with pytest.raises(AssertionError, match="greedy tokens differ from HF"):
        _check(moe, block_size=8, max_num_batched_tokens=512)


def _recording_counts(monkeypatch) -> list[tuple[int, ...]]:
    """Each routed layer call's tokens per expert, in call order."""
    seen: list[tuple[int, ...]] = []
    route = RoutedExperts.route

    def recorded(self, x):
        weights, index = route(self, x)
        seen.append(tuple(torch.bincount(index.reshape(-1), minlength=self.count).tolist()))
        return weights, index

    monkeypatch.setattr(RoutedExperts, "route", recorded)
    return seen


def _tokens_and_logprobs(engine, requests) -> dict[str, tuple[list[int], list[float]]]:
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    out: dict[str, tuple[list[int], list[float]]] = {rid: ([], []) for rid in requests}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            out[delta.request_id][0].extend(delta.new_token_ids)
            out[delta.request_id][1].extend(lp.logprob for lp in delta.logprobs or ())
    return out


@pytest.mark.parametrize("quantized", [False, True], ids=["fp32", "gguf Q8_0 experts, int8 activations"])
def test_a_request_is_bitwise_its_solo_run_whatever_its_experts_share(moe, quantized, tmp_path, monkeypatch):
    """One request alone, then in a mix of others (chunked, so its chunks share steps with other
    requests' tokens): its tokens and logprobs are the same bits, and the mix really changed how many
    rows each expert's GEMMs got in the steps it was in."""
    from tests.gguf_files import write_gguf

    arch, model_dir, _, prompts, _ = moe
    model = model_dir
    if quantized:
        model = write_gguf(model_dir, tmp_path / f"tiny-{arch}-q8_0.gguf", "Q8_0")
    options = dict(
        block_size=8, max_num_batched_tokens=24, quantized_activations="int8" if quantized else "none"
    )
    params = SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3)
    target = prompts[4]  # 17 tokens: chunked under the budget
    seen = _recording_counts(monkeypatch)
    solo = _tokens_and_logprobs(make_engine(model, **options), {"target": (target, params)})
    solo_counts = set(seen)
    seen.clear()
    rng = random.Random(7)
    others = {
        f"o{i}": (p, SamplingParams(temperature=0.0, max_tokens=rng.randint(2, MAX_NEW), ignore_eos=True))
        for i, p in enumerate(rng.sample(prompts, 5))
    }
    mixed = _tokens_and_logprobs(make_engine(model, **options), {**others, "target": (target, params)})
    assert mixed["target"] == solo["target"]
    assert len(solo["target"][1]) == MAX_NEW
    uneven = [c for c in set(seen) - solo_counts if len({n for n in c if n}) > 1]
    assert uneven, "the mix never gave the experts row counts the solo run had not"


def test_random_mixes_equal_their_solo_runs(moe):
    from tests.test_batch_invariance import EXAMPLES, explore

    required = ("chunked prefills", "prefix-hit tokens", "general steps")
    explore(
        moe[1], max(6, EXAMPLES // 4), {"speculative_config": None, "max_num_batched_tokens": 16}, required
    )


@pytest.fixture(scope="module")
def moe_gguf(moe, tmp_path_factory):
    from tests.gguf_files import write_gguf

    arch, model_dir, hf, prompts, refs = moe
    path = write_gguf(model_dir, tmp_path_factory.mktemp(f"{arch}_gguf") / f"tiny-{arch}-f32.gguf", "F32")
    return arch, model_dir, hf, prompts, refs, path


def test_gguf_of_it_gives_hfs_tokens(moe_gguf):
    """Our reader of the stacked experts (and, for Qwen3-MoE, of a dense layer among them, which
    llama.cpp's qwen3moe graph does not have: a layer without ``ffn_gate_inp`` reads as dense)."""
    arch, model_dir, hf, prompts, refs, path = moe_gguf
    spec = ModelSpec.from_path(path)
    assert spec.architecture == hf.config.architectures[0]
    assert [e is not None for e in spec.layer_experts] == [
        e is not None for e in ModelSpec.from_path(model_dir).layer_experts
    ]
    check_greedy_equals_hf(path, hf, prompts, refs, MAX_NEW, block_size=8, max_num_batched_tokens=16)


def test_transformers_reads_the_stacked_experts_back(tmp_path, trained_tokenizer_dir):
    """The writer checked by an independent reader: transformers' own GGUF loader reads a
    qwen3moe file (every layer routed, as llama.cpp has it) back to HF's weights. (Mixtral is
    written as llama with experts, which transformers does not read; its tokens above are the check.)"""
    from tests.gguf_files import write_gguf

    shape = {**MODELS["qwen3_moe"], "mlp_only_layers": [], "num_hidden_layers": 2}
    model_dir = random_model(
        tmp_path / "hf", trained_tokenizer_dir, "qwen3_moe", seed=40, vocab_size=VOCAB, **shape
    )
    path = write_gguf(model_dir, tmp_path / "tiny-qwen3moe-f32.gguf", "F32")
    # (transformers' GGUF config for qwen3moe maps no expert width, and defaults the pad id)
    theirs = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, pad_token_id=0, moe_intermediate_size=32
    ).state_dict()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").state_dict()
    assert hf.keys() == theirs.keys()
    for name, tensor in hf.items():
        assert torch.equal(theirs[name], tensor), name


def test_q8_0_file_serves_each_expert_from_its_row_range_of_the_blocks(moe_gguf, tmp_path):
    """Each expert's gate/up and down linears are its rows of the stacked Q8_0 tensors, served by
    the quantized GEMM (no float copy), bit-equal to the dequantized file's fp32 GEMMs."""
    from tests.gguf_files import write_gguf

    arch, model_dir = moe_gguf[:2]
    path = write_gguf(model_dir, tmp_path / f"tiny-{arch}-q8_0.gguf", "Q8_0")
    blocks = make_engine(path, num_kv_blocks=64, quantized_activations="none")
    floats = make_engine(path, num_kv_blocks=64, quantization="none")
    for a, b in zip(blocks.model.layers, floats.model.layers, strict=True):
        if a.experts is None:  # Qwen3-MoE's dense layer
            assert a.gate_up_proj.fmt == "Q8_0"
            continue
        ours_all = a.experts.gate_up_projs + a.experts.down_projs
        pairs = list(zip(ours_all, b.experts.gate_up_projs + b.experts.down_projs, strict=True))
        assert len(pairs) == 2 * a.experts.count
        for ours, theirs in pairs:
            assert ours.fmt == "Q8_0"
            inp = torch.randn(5, ours.in_features)
            assert torch.equal(ours(inp), theirs(inp))
        assert a.experts.gate_up_weights[0].numel() == 0  # the float parameters freed once packed
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    prompts = {str(i): (p, params) for i, p in enumerate(moe_gguf[3])}
    assert run_to_completion(blocks, prompts) == run_to_completion(floats, prompts)


@pytest.mark.parametrize(
    "change,words",
    [
        ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size 64"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok 9 must be 1..8"),
        ({"architectures": ["Qwen2MoeForCausalLM"]}, "unsupported architecture.*Qwen2MoeForCausalLM"),
    ],
)
def test_what_is_not_built_refuses_naming_the_field(change, words):
    from engine_svc.models.build import make_config

    cfg = make_config("qwen3_moe", **MODELS["qwen3_moe"]).to_dict()
    cfg = {**cfg, "architectures": ["Qwen3MoeForCausalLM"], **change}
    with pytest.raises(ValueError, match=words):
        ModelSpec.from_dict(cfg)


@pytest.mark.parametrize("option,words", UNTESTED_FEATURES)
def test_untested_features_refuse_it_at_start(moe, option, words):
    check_refused_at_start(moe[1], moe[2].config.architectures[0], option, words)


def test_k_quant_experts_are_served_from_their_blocks(tmp_path, trained_tokenizer_dir):
    """A real MoE GGUF keeps its experts in K-quants (256-value super-blocks): each expert's rows
    of a stacked Q4_K tensor run on the quantized GEMM, bit-equal to the dequantized file's fp32
    GEMMs, and the tokens are the same."""
    from tests.gguf_files import write_gguf

    shape = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4)
    shape |= dict(num_key_value_heads=2, num_experts=4, moe_intermediate_size=256, mlp_only_layers=[])
    model_dir = random_model(
        tmp_path / "hf", trained_tokenizer_dir, "qwen3_moe", seed=3, vocab_size=VOCAB, **shape
    )
    path = write_gguf(model_dir, tmp_path / "tiny-qwen3moe-q4_k.gguf", "Q4_K")
    blocks = make_engine(path, num_kv_blocks=64, quantized_activations="none")
    floats = make_engine(path, num_kv_blocks=64, quantization="none")
    a, b = blocks.model.layers[0].experts, floats.model.layers[0].experts
    for ours, theirs in zip(a.gate_up_projs + a.down_projs, b.gate_up_projs + b.down_projs, strict=True):
        assert ours.fmt == "Q4_K"
        inp = torch.randn(5, ours.in_features)
        assert torch.equal(ours(inp), theirs(inp))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    requests = {str(i): ([5 + i, 9, 33, 70 + i], params) for i in range(3)}
    assert run_to_completion(blocks, requests) == run_to_completion(floats, requests)


def test_qwen3_moe_without_renormalisation_and_a_sparse_step_equals_hf(tmp_path, trained_tokenizer_dir):
    """``norm_topk_prob`` false (the top-k softmax weights as they are) and ``decoder_sparse_step``
    2 (routed experts on every second layer): still HF's tokens."""
    shape = {**MODELS["qwen3_moe"], "norm_topk_prob": False, "decoder_sparse_step": 2, "mlp_only_layers": []}
    model_dir = random_model(
        tmp_path / "hf", trained_tokenizer_dir, "qwen3_moe", seed=5, vocab_size=VOCAB, **shape
    )
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32").eval()
    prompts, refs = hf_reference_prompts(hf, [1, 9, 17], VOCAB, MAX_NEW)
    engine = check_greedy_equals_hf(
        model_dir, hf, prompts, refs, MAX_NEW, block_size=8, max_num_batched_tokens=16
    )
    assert [layer.experts is not None for layer in engine.model.layers] == [False, True, False]
    assert not engine.model.layers[1].experts.renormalize
