"""The text side of a model: a Hugging Face tokenizer with its chat template, behind a small API.

Encoding and decoding go straight to the Rust ``tokenizers`` backend so that the whole-text decode
here and the incremental decode in ``detokenizer.py`` are the same function (transformers' own
``decode`` may also clean up spaces, which no streaming decoder can reproduce token by token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizer_svc.chat_encoding import SpecialTokens, encode_chat
from tokenizer_svc.tokenizer_files import find_tokenizer_dir

# transformers' placeholder for "no limit configured" (int(1e30)); anything this large means none.
_NO_LENGTH_LIMIT = 10**18


def validate_messages(messages: object) -> list[dict]:
    """Check chat messages before a template sees them: a list of dicts with string role and content."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("chat messages must be a non-empty list of {'role', 'content'} dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"chat message {i} is {type(message).__name__}, expected a dict")
        for key in ("role", "content"):
            if key not in message:
                raise ValueError(f"chat message {i} has no '{key}'")
            if not isinstance(message[key], str):
                raise ValueError(f"chat message {i}: '{key}' must be a string")
    return messages


class Tokenizer:
    """One model's tokenizer: encode, decode, chat template, special tokens."""

    def __init__(self, hf_tokenizer) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError("only fast tokenizers (a tokenizer.json) are supported")
        self._hf = hf_tokenizer
        self._backend = hf_tokenizer.backend_tokenizer
        special = set(hf_tokenizer.all_special_ids)
        # Added tokens flagged special (e.g. <|im_start|>) are skipped by decode even when no
        # special_tokens_map names them; count them as special too so both views agree.
        special.update(i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special)
        self._special_ids = frozenset(special)
        self._specials = SpecialTokens(hf_tokenizer.convert_ids_to_tokens(sorted(special)))

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` that does the work (used by the incremental detokenizer)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self._hf)

    @property
    def eos_token_id(self) -> int | None:
        return self._hf.eos_token_id

    @property
    def bos_token_id(self) -> int | None:
        return self._hf.bos_token_id

    @property
    def all_special_ids(self) -> frozenset[int]:
        return self._special_ids

    @property
    def model_max_length(self) -> int | None:
        """The configured maximum input length, or None where the tokenizer config sets none."""
        value = self._hf.model_max_length
        return None if value is None or value >= _NO_LENGTH_LIMIT else int(value)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._hf.chat_template)

    def encode(
        self, text: str, add_special_tokens: bool = True, parse_special_tokens: bool = True
    ) -> list[int]:
        """``parse_special_tokens=False``: a special token's string in ``text`` is plain text (the
        gateway's default for client text); ``add_special_tokens`` still adds BOS where the
        tokenizer does."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        if parse_special_tokens or not self._specials.found_in(text):
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        # One backend per tokenizer, used by one thread at a time (a worker, or the event loop).
        self._backend.encode_special_tokens = True
        try:
            return self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        finally:
            self._backend.encode_special_tokens = False

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> str:
        """The prompt text the model's chat template (or ``chat_template``) makes of ``messages``."""
        if chat_template is None and not self.has_chat_template:
            raise ValueError("this model has no chat template; send a text prompt instead")
        validate_messages(messages)
        return self._hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, chat_template=chat_template
        )

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None
    ) -> list[int]:
        """The template's markers are special tokens; the messages' roles and contents are plain
        text (chat_encoding.py). The template writes BOS itself; adding special tokens again would
        double them (the convention of transformers' own tokenize=True path)."""
        validate_messages(messages)
        return encode_chat(
            messages,
            lambda msgs: self.render_chat(msgs, add_generation_prompt, chat_template),
            self._specials,
            lambda text, parse: self.encode(text, add_special_tokens=False, parse_special_tokens=parse),
            self._backend.token_to_id,
        )

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._hf.convert_ids_to_tokens(ids)
        return self._hf.convert_ids_to_tokens(list(ids))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)


def load_tokenizer(model: str | Path) -> Tokenizer:
    """Load the tokenizer of a model folder (tokenizer.json, tokenizer_config.json, chat template)
    or of a GGUF file (from its metadata)."""
    from transformers import AutoTokenizer

    path = find_tokenizer_dir(model)
    if path is None:
        raise FileNotFoundError(f"no tokenizer.json in {model}")
    return Tokenizer(AutoTokenizer.from_pretrained(str(path), use_fast=True))
