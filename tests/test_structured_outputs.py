"""Structured output and logit controls at engine level, on random-weight models.

With random weights every finished output must still be valid: JSON parses and validates against
its schema (``jsonschema``), a regex fully matches, a choice is one of the choices, a grammar's
output is accepted by a fresh llguidance matcher (the library's own parser); an output cut by
``max_tokens`` (finish "length") is a valid prefix. Constrained and unconstrained requests share
steps without changing each other. Bad specs and bad ids are refused with the field named.
"""

from __future__ import annotations

import json
import re
import shutil
from functools import partial

import jsonschema
import pytest

from engine_svc import SamplingParams, StructuredOutputsParams
from tests.conftest import shared_tokenizer
from tests.differential import Result, assert_same_as_solo, drive, solo
from tests.engine_helpers import assert_pool_whole, make_engine, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ada", "bob", "cy"]},
        "ok": {"type": "boolean"},
        "size": {"type": "integer", "minimum": 0, "maximum": 99},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}
REGEX = r"(yes|no)-[0-9]{2,4}(\.[a-c]+)?"
CHOICES = ["red", "green apple", 'blue "sky"', "dark\nnight"]
GRAMMAR = 'start: expr\nexpr: term (("+" | "-") term)*\nterm: NUMBER | "(" expr ")"\nNUMBER: /[0-9]{1,3}/\n'


def tokenizer_of(model_dir):
    from tokenizer_svc.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


def constraint_cases():
    return {
        "json": StructuredOutputsParams(json=SCHEMA),
        "json_object": StructuredOutputsParams(json_object=True),
        "regex": StructuredOutputsParams(regex=REGEX),
        "choice": StructuredOutputsParams(choice=CHOICES),
        "grammar": StructuredOutputsParams(grammar=GRAMMAR),
    }


def matcher_accepts(model_dir, spec: StructuredOutputsParams, token_ids: list[int], whole: bool) -> bool:
    """The library's own parser: a fresh matcher consumes the tokens (and is accepting, if whole)."""
    import llguidance

    engine_vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tok = llguidance.LLTokenizer(str(model_dir / "tokenizer.json"), n_vocab=engine_vocab)
    m = llguidance.LLMatcher(tok, spec.to_grammar())
    return all(m.consume_token(t) for t in token_ids) and (m.is_accepting() or not whole)


def check_valid(kind: str, spec, text: str, token_ids: list[int], finish: str, model_dir) -> None:
    if finish == "length":  # cut short: a valid prefix
        assert matcher_accepts(model_dir, spec, token_ids, whole=False), (kind, text)
        return
    assert finish == "stop", (kind, finish, text)
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "json_object":
        json.loads(text)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    assert matcher_accepts(model_dir, spec, token_ids, whole=True), (kind, text)


def run_constrained(model_dir, cases: dict, n=2, max_tokens=60, seeds=range(3)):
    engine = make_engine(model_dir, block_size=16, num_kv_blocks=512, max_num_batched_tokens=256)
    (prompt,) = random_prompts([9], engine.spec.vocab_size, seed=4)
    for kind, spec in cases.items():
        for s in seeds:
            p = SamplingParams(n=n, temperature=1.0, seed=s, max_tokens=max_tokens, structured_outputs=spec)
            engine.add_request(f"{kind}/{s}", prompt, p)
    results: dict[str, Result] = {}
    drive(engine, results)
    assert_pool_whole(engine)
    return engine, results


@pytest.mark.parametrize("kind", list(constraint_cases()))
def test_every_output_is_valid(tiny_llama, kind):
    spec = constraint_cases()[kind]
    _, results = run_constrained(tiny_llama, {kind: spec})
    tok = tokenizer_of(tiny_llama)
    finishes = []
    for r in results.values():
        for out in r.outputs.values():
            ids = [t for t in out.tokens if not (out.finish_reason == "stop" and t == out.stop_token_id)]
            text = tok.decode(ids, skip_special_tokens=False)
            check_valid(kind, spec, text, ids, out.finish_reason, tiny_llama)
            finishes.append(out.finish_reason)
    if kind in ("choice", "regex", "json"):
        assert "stop" in finishes, f"{kind}: no output finished whole ({finishes})"


def test_truncated_output_is_a_valid_prefix(tiny_llama):
    spec = StructuredOutputsParams(json=SCHEMA)
    _, results = run_constrained(tiny_llama, {"json": spec}, max_tokens=4)
    for r in results.values():
        for out in r.outputs.values():
            assert out.finish_reason == "length"
            assert matcher_accepts(tiny_llama, spec, out.tokens, whole=False)


def test_constrained_and_plain_requests_share_steps_unchanged(tiny_llama):
    opts = dict(block_size=8, num_kv_blocks=96, max_num_batched_tokens=24)
    prompts = random_prompts([20, 33, 7, 41], 1024, seed=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2, ignore_eos=True),
        SamplingParams(
            n=2,
            temperature=1.0,
            seed=8,
            max_tokens=30,
            structured_outputs=StructuredOutputsParams(regex=REGEX),
        ),
        SamplingParams(temperature=0.9, seed=5, max_tokens=20, logit_bias={7: 5.0, 9: -100.0}),
        SamplingParams(
            temperature=1.0,
            seed=3,
            max_tokens=40,
            structured_outputs=StructuredOutputsParams(json=SCHEMA),
            logprobs=1,
        ),
    ]
    engine = make_engine(tiny_llama, **opts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    results: dict[str, Result] = {}
    drive(engine, results)
    assert_pool_whole(engine)
    fresh = partial(make_engine, tiny_llama, **opts)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        assert_same_as_solo(f"r{i}", results[f"r{i}"], solo(fresh, prompt, p), p)


def test_a_second_request_with_the_same_spec_pays_no_compile(tiny_llama):
    engine, _ = run_constrained(tiny_llama, {"json": StructuredOutputsParams(json=SCHEMA)}, n=1, max_tokens=8)
    assert engine.grammars.num_compiled == 1


def test_logit_bias_allowed_ids_and_bad_words(tiny_llama):
    engine = make_engine(tiny_llama)
    (prompt,) = random_prompts([10], 1024, seed=2)
    engine.add_request(
        "bias", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={77: 100.0})
    )
    allowed = [5, 50, 500]
    engine.add_request(
        "allowed",
        prompt,
        SamplingParams(temperature=1.0, seed=1, max_tokens=30, ignore_eos=True, allowed_token_ids=allowed),
    )
    engine.add_request("plain", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    results: dict[str, Result] = {}
    drive(engine, results)
    assert results["bias"].outputs[0].tokens == [77] * 6
    assert set(results["allowed"].outputs[0].tokens) <= set(allowed)
    plain = results["plain"].outputs[0].tokens
    # Ban what greedy decoding said: the single token always, and a pair only after its first token.
    single, (a, b) = plain[0], plain[3:5]
    engine.add_request(
        "bad",
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=30, ignore_eos=True, bad_words_token_ids=[[single], [a, b]]
        ),
    )
    drive(engine, results)
    bad = results["bad"].outputs[0].tokens
    assert single not in bad
    assert all(bad[i : i + 2] != [a, b] for i in range(len(bad) - 1))
    assert_pool_whole(engine)


@pytest.mark.parametrize(
    "spec, field",
    [
        (StructuredOutputsParams(json={"type": "objec"}), "structured_outputs.json"),
        (StructuredOutputsParams(json="{not json"), "structured_outputs.json"),
        (StructuredOutputsParams(regex="(a|b"), "structured_outputs.regex"),
        (StructuredOutputsParams(grammar="start: foo"), "structured_outputs.grammar"),
        (StructuredOutputsParams(choice=[]), "structured_outputs.choice"),
        (StructuredOutputsParams(), "exactly one of"),
        (StructuredOutputsParams(regex="a", choice=["a"]), "exactly one of"),
    ],
)
def test_bad_specs_are_refused_naming_the_field(tiny_llama, spec, field):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("x", [5, 6, 7], SamplingParams(structured_outputs=spec))
    assert not engine.requests and not engine.scheduler.waiting


def test_a_spec_sent_again_is_built_once_and_a_bad_one_refused_every_time():
    """A session's tools arrive as one grammar on every turn: built and checked once, the same
    grammar each time; a bad spec is never kept (its error every time, naming the field)."""
    from engine_svc import structured_outputs as so

    spec = StructuredOutputsParams(json={"type": "object", "properties": {"turn": {"type": "integer"}}})
    same = StructuredOutputsParams(json=json.dumps(spec.json))  # the same schema as its JSON text
    before = so._kept_grammar.cache_info()
    first = spec.to_grammar()
    assert spec.to_grammar() == first == same.to_grammar()
    after = so._kept_grammar.cache_info()
    assert after.hits - before.hits == 2 and after.misses - before.misses == 1
    bad = StructuredOutputsParams(regex="(a|b")
    for _ in range(2):
        with pytest.raises(ValueError, match=re.escape("structured_outputs.regex")):
            bad.to_grammar()
    assert so._kept_grammar.cache_info().currsize == after.currsize
    huge = StructuredOutputsParams(regex="a" * (so.KEPT_BYTES + 1))  # checked, not kept
    assert huge.to_grammar() and so._kept_grammar.cache_info().currsize == after.currsize


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(logit_bias={5000: 1.0}), "logit_bias[5000]"),
        (dict(logit_bias={5: 101.0}), "logit_bias[5]"),
        (dict(logit_bias={5: float("nan")}), "logit_bias[5]"),
        (dict(allowed_token_ids=[]), "allowed_token_ids"),
        (dict(allowed_token_ids=[1, -1]), "allowed_token_ids"),
        (dict(bad_words_token_ids=[[]]), "bad word"),
        (dict(bad_words_token_ids=[[1, 99999]]), "bad_words_token_ids[0][1]"),
    ],
)
def test_bad_logit_controls_are_refused(tiny_llama, params, field):
    engine = make_engine(tiny_llama)
    with pytest.raises(ValueError, match=re.escape(field)):
        engine.add_request("x", [5, 6, 7], SamplingParams(**params))
    assert not engine.requests


def test_a_model_without_a_tokenizer_refuses_structured_outputs(tmp_path, tiny_llama):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama, bare)
    (bare / "tokenizer.json").unlink()
    engine = make_engine(bare)
    with pytest.raises(ValueError, match="tokenizer.json"):
        engine.add_request(
            "x", [5, 6], SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
        )


@pytest.mark.parametrize("name", ["qwen2", "llama3"])
def test_real_tokenizers_give_valid_json_and_choices(tmp_path, name):
    """Multi-byte and merged tokens of real vocabularies, on a random model of that vocabulary."""
    from engine_svc.models.build import build_random_model

    tok_dir = shared_tokenizer(name)
    from tokenizers import Tokenizer

    backend = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    eos = json.loads((tok_dir / "tokenizer_config.json").read_text())["eos_token"]
    eos_id = backend.token_to_id(eos if isinstance(eos, str) else eos["content"])
    vocab = backend.get_vocab_size(with_added_tokens=True) + 64
    model = build_random_model(tmp_path / name, "llama", seed=3, vocab_size=vocab, eos_token_id=eos_id)
    for f in tok_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, model / f.name)
    cases = {
        "json": StructuredOutputsParams(json=SCHEMA),
        "choice": StructuredOutputsParams(choice=["naïve café", "日本語のテキスト", "emoji 🎉"]),
    }
    _, results = run_constrained(model, cases, n=1, max_tokens=80, seeds=range(2))
    tok = tokenizer_of(model)
    for rid, r in results.items():
        kind = rid.split("/")[0]
        out = r.outputs[0]
        ids = [t for t in out.tokens if not (out.finish_reason == "stop" and t == out.stop_token_id)]
        text = tok.decode(ids, skip_special_tokens=False)
        if kind == "choice":
            assert out.finish_reason == "stop" and text in cases["choice"].choice, text
        else:
            check_valid("json", cases["json"], text, ids, out.finish_reason, model)


def test_a_slow_grammar_holds_back_nobody(tiny_llama):
    """A regex whose compile takes seconds (1000 x 1000 repetitions) compiles off the loop: a plain
    request added after it runs to its end meanwhile, and then the constrained one runs too."""
    import time

    engine = make_engine(tiny_llama)
    (prompt,) = random_prompts([8], 1024, seed=3)
    slow = StructuredOutputsParams(regex="(x{1000}){1000}")
    engine.add_request("slow", prompt, SamplingParams(temperature=0.0, max_tokens=5, structured_outputs=slow))
    engine.add_request("plain", prompt, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    finished_at: dict[str, float] = {}
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        for d in engine.step():
            if d.request_finished:
                finished_at[d.request_id] = time.perf_counter() - t0
        assert time.perf_counter() - t0 < 120, "the grammar's compile was not bounded"
    assert finished_at["plain"] < finished_at["slow"], finished_at
    assert_pool_whole(engine)


def test_a_constraint_that_leaves_no_token_ends_the_request_and_says_why(tiny_llama):
    """The grammar wants "red"/"green..." while allowed_token_ids permit only digits: the mask leaves
    the row nothing. The request ends at once with the reason, emits no token outside its grammar,
    and its neighbour runs on as it would alone."""
    from engine_svc.scheduler import dead_end_error

    tok = tokenizer_of(tiny_llama)
    digits = sorted({i for d in "0123456789" for i in tok.encode(d, add_special_tokens=False)})
    engine = make_engine(tiny_llama)
    (prompt,) = random_prompts([12], 1024, seed=5)
    stuck = SamplingParams(
        temperature=0.0,
        max_tokens=20,
        n=2,
        allowed_token_ids=digits,
        structured_outputs=StructuredOutputsParams(choice=["red", "green apple"]),
    )
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    engine.add_request("stuck", prompt, stuck)
    engine.add_request("plain", prompt, plain)
    results: dict[str, Result] = {}
    errors: list[str] = []
    steps = 0
    while engine.has_unfinished_requests():
        for d in engine.step():
            results.setdefault(d.request_id, Result()).add(d)
            if d.error:
                errors.append(d.error)
        engine.check_invariants()
        steps += 1
        assert steps < 200, "the engine looped on a dead end"
    for out in results["stuck"].outputs.values():
        assert out.finish_reason == "abort" and out.tokens == []
    assert errors == [dead_end_error(stuck)] * 2
    assert "structured_outputs, allowed_token_ids" in errors[0]
    fresh = partial(make_engine, tiny_llama)
    assert_same_as_solo("plain", results["plain"], solo(fresh, prompt, plain), plain)
    assert_pool_whole(engine)


def test_the_grammar_vocabulary_is_built_by_the_first_structured_request(tiny_llama):
    """Its tables (hundreds of MiB for a real vocabulary) are not held by an engine that never sees
    a structured request; the first one builds them, on the compile thread."""
    engine = make_engine(tiny_llama)
    assert engine.grammars is not None and engine.grammars._tokenizer is None
    plain = SamplingParams(temperature=0.0, max_tokens=3)
    engine.add_request("plain", [5, 6, 7], plain)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.grammars._tokenizer is None
    structured = SamplingParams(
        temperature=0.0, max_tokens=4, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
    )
    engine.add_request("choice", [5, 6, 7], structured)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.grammars._tokenizer is not None and engine.grammars.num_compiled == 1


@pytest.mark.parametrize("vocab", [151936, 1000, 1024])
def test_the_cpu_mask_fill_equals_the_device_expansion(vocab):
    """``apply_grammar_bitmask`` on CPU (numpy unpacks the refused bits, rows filled in place) against
    the device path (the words expanded by shifts), on CPU tensors: random masks, some rows of a
    batch, a vocabulary that ends inside a word."""
    import numpy as np
    import torch

    from engine_svc.logits_processors.grammar import _apply_on_device, apply_grammar_bitmask

    rng = np.random.default_rng(vocab)
    words = (vocab + 31) // 32
    mask = rng.integers(-(2**31), 2**31, size=(3, words), dtype=np.int64).astype(np.int32)
    mask[1] = -1  # every token allowed
    mask[2, : words // 2] = 0  # the first half refused
    logits = torch.randn(6, vocab)
    rows = [0, 2, 5]
    got, want = logits.clone(), logits.clone()
    apply_grammar_bitmask(got, rows, mask)
    _apply_on_device(want, rows, mask)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 4]], logits[[1, 3, 4]])  # the other rows untouched
    assert torch.equal(got[2], logits[2])  # mask[1] allows everything
    refused = torch.isinf(got[5])
    assert refused[: 32 * (words // 2)].all() and not refused[32 * (words // 2) :].all()
    token = int(rng.integers(vocab))  # one token against its bit, read independently
    assert bool(torch.isinf(got[0, token])) != bool((int(mask[0, token // 32]) >> (token % 32)) & 1)
