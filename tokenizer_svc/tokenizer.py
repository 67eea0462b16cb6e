"""The text side of a model: a Hugging Face tokenizer with its chat template, behind a small API.

Encoding and decoding go straight to the Rust ``tokenizers`` backend so that the whole-text decode
here and the incremental decode in ``detokenizer.py`` are the same function (transformers' own
``decode`` may also clean up spaces, which no streaming decoder can reproduce token by token).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizer_svc.chat_encoding import SpecialTokens, encode_chat, encode_pieces
from tokenizer_svc.chat_messages import validate_messages, validate_tools
from tokenizer_svc.piece_cache import PieceCache, piecewise_exact
from tokenizer_svc.tokenizer_files import find_tokenizer_dir

__all__ = ["Tokenizer", "load_tokenizer", "validate_messages"]

# transformers' placeholder for "no limit configured" (int(1e30)); anything this large means none.
_NO_LENGTH_LIMIT = 10**18


class Tokenizer:
    """One model's tokenizer: encode, decode, chat template, special tokens."""

    def __init__(self, hf_tokenizer, chat_template: str | None = None) -> None:
        if not getattr(hf_tokenizer, "is_fast", False):
            raise ValueError("only fast tokenizers (a tokenizer.json) are supported")
        self._hf = hf_tokenizer
        if chat_template is not None:  # --chat-template: replaces the model's own
            hf_tokenizer.chat_template = chat_template
        self._backend = hf_tokenizer.backend_tokenizer
        special = set(hf_tokenizer.all_special_ids)
        # Added tokens flagged special (e.g. <|im_start|>) are skipped by decode even when no
        # special_tokens_map names them; count them as special too so both views agree.
        special.update(i for i, tok in hf_tokenizer.added_tokens_decoder.items() if tok.special)
        self._special_ids = frozenset(special)
        self._specials = SpecialTokens(hf_tokenizer.convert_ids_to_tokens(sorted(special)))
        # A chat prompt's long pieces between markers, kept across requests (piece_cache.py).
        self._pieces = PieceCache() if piecewise_exact(hf_tokenizer) else None

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

    @property
    def has_thinking_switch(self) -> bool:
        """Whether the chat template reads an ``enable_thinking`` variable (Qwen3's switch)."""
        return "enable_thinking" in self.chat_template_text

    @property
    def chat_template_text(self) -> str:
        """The chat template's Jinja text ("" when there is none; the default of several named)."""
        t = self._hf.chat_template
        if isinstance(t, dict):
            t = t.get("default") or next(iter(t.values()), "")
        return t or ""

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
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
    ) -> str:
        """The prompt text the model's chat template (or ``chat_template``) makes of ``messages``
        (and ``tools``, which the template reads as its ``tools`` variable: HF's convention;
        ``enable_thinking``, where set, as its ``enable_thinking`` variable: Qwen3's switch)."""
        if chat_template is None and not self.has_chat_template:
            raise ValueError("this model has no chat template; send a text prompt instead")
        validate_messages(messages)
        validate_tools(tools)
        extra = {"tools": tools} if tools else {}
        if enable_thinking is not None:
            extra["enable_thinking"] = enable_thinking
        try:
            return self._hf.apply_chat_template(
                messages,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                chat_template=chat_template,
                **extra,
            )
        except Exception as e:  # the template raised (raise_exception) or failed on these messages
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"the chat template failed: {type(e).__name__}: {e}") from None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
        enable_thinking: bool | None = None,
    ) -> list[int]:
        """The template's markers are special tokens; every string of the messages and tools is
        plain text (chat_encoding.py). The template writes BOS itself; adding special tokens again
        would double them (the convention of transformers' own tokenize=True path)."""
        validate_messages(messages)
        validate_tools(tools)
        return encode_chat(
            messages,
            lambda msgs, tls: self.render_chat(
                msgs, add_generation_prompt, chat_template, tls, enable_thinking
            ),
            self._specials,
            self._encode_rendered,
            self._backend.token_to_id,
            tools,
        )

    def _encode_rendered(self, text: str, parse_special_tokens: bool) -> list[int]:
        """A rendered prompt's ids (no BOS added: the template writes it). With its special tokens
        parsed and a tokenizer that allows it, piece by piece between the special tokens' strings,
        a long piece's ids from the piece cache: the same ids as the whole text's encode."""
        pieces = self._pieces
        if not parse_special_tokens or pieces is None or len(text) < pieces.min_chars:
            return self.encode(text, add_special_tokens=False, parse_special_tokens=parse_special_tokens)
        backend = self._backend

        def plain(piece: str) -> list[int]:  # no special token's string in it: parsing finds none
            return backend.encode(piece, add_special_tokens=False).ids

        def kept(piece: str):
            return pieces.ids(piece, plain)

        return encode_pieces(text, self._specials, kept, backend.token_to_id)

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._hf.convert_ids_to_tokens(ids)
        return self._hf.convert_ids_to_tokens(list(ids))

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)


def load_tokenizer(model: str | Path, chat_template: str | Path | None = None) -> Tokenizer:
    """Load the tokenizer of a model folder (tokenizer.json, tokenizer_config.json, chat template)
    or of a GGUF file (from its metadata); ``chat_template``: a Jinja file that replaces the
    model's template."""
    from transformers import AutoTokenizer

    path = find_tokenizer_dir(model)
    if path is None:
        raise FileNotFoundError(f"no tokenizer.json in {model}")
    template = Path(chat_template).read_text() if chat_template is not None else None
    return Tokenizer(AutoTokenizer.from_pretrained(str(path), use_fast=True), chat_template=template)
