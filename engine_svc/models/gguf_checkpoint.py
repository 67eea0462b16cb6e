"""A GGUF file as a checkpoint: its metadata as an HF-style config, its tensors under HF names.

Read with the ``gguf`` package (llama.cpp's own reader): the file is memory-mapped and every tensor
is a view of its blocks, so a caller may dequantize it (``GGUFTensor.dequantize``) or, later, keep
the blocks as they are for a quantized kernel. What llama.cpp's converter changed on the way in is
undone here: its tensor names, its reversed dimension order, and, for the Llama family, the
interleaved row order of the q/k projections that its rotary kernel wants, and the ``1 + w`` it
stored for norms of that style. Each architecture's names and quirks are its declaration's
(``engine_svc/models/arch/``).
"""

from __future__ import annotations

import functools
import mmap
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, quants

from engine_svc.models import arch as archs
from engine_svc.models.arch import GLOBAL_GGUF_NAMES
from engine_svc.models.gguf_metadata import CompactReader

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
# Tensors a converter writes that the forward pass derives itself or has no use for, or that the
# config reads (rotary frequency factors: ``_rope_scaling``, Phi-3's ``gguf_long_rope``).
_DERIVED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}


SUPPORTED_TYPES = {
    GGMLQuantizationType[name]: name
    for name in "F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS Q2_K Q3_K Q4_K Q5_K Q6_K".split()
}


@dataclass(frozen=True)
class GGUFTensor:
    gguf_name: str
    hf_name: str
    type_name: str
    shape: tuple[int, ...]  # in torch order (rows first), as the HF tensor has it
    _reader_tensor: object
    _permute_heads: int | None  # q/k of the Llama family: rows to put back in HF order
    _offset: float = 0.0  # a norm stored as offset + w: subtracted (HF's spelling)

    def dequantize(self) -> torch.Tensor:
        """The tensor in fp32, in HF layout."""
        t = self._reader_tensor
        try:
            array = quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # a gguf quirk or a bad block: say which tensor
            raise ValueError(
                f"GGUF tensor {self.gguf_name} ({self.type_name}) cannot be dequantized: {e}"
            ) from e
        array = np.ascontiguousarray(array, dtype=np.float32)
        if not array.flags.writeable:  # an F32 tensor comes back as a view of the read-only map
            array = array.copy()
        tensor = torch.from_numpy(array).reshape(self.shape)
        if self._permute_heads is not None:
            tensor = _unpermute_rows(tensor, self._permute_heads)
        if self._offset:
            tensor = tensor - self._offset
        return tensor


def _unpermute_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    # The converter stores, per head, the rotary pairs (i, i + d/2) next to each other; HF keeps the
    # two halves apart. Rows [h, pair, 2] -> [h, 2, pair].
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class GGUFCheckpoint:
    """One GGUF file: ``config()`` for ModelSpec, ``tensors()`` for the loader."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = _open_reader(self.path)
        self.architecture = self.field("general.architecture")
        experts = bool(self.field(f"{self.architecture}.expert_count"))  # Mixtral is written as llama
        self.declaration = archs.by_gguf(self.architecture, experts)
        if self.declaration is None:
            raise ValueError(
                f"GGUF file {self.path.name} has architecture {self.architecture!r}; supported: "
                f"{', '.join(archs.gguf_names())}"
            )
        for t in self.reader.tensors:
            if t.tensor_type not in SUPPORTED_TYPES:
                raise ValueError(
                    f"GGUF tensor {t.name} has type {GGMLQuantizationType(t.tensor_type).name}; supported "
                    f"types: {', '.join(SUPPORTED_TYPES.values())}"
                )
        self._by_name = {t.name: t for t in self.reader.tensors}

    def tensor(self, hf_name: str) -> GGUFTensor | None:
        """The tensor of that HF name, or None."""
        return next((t for t in self.tensors() if t.hf_name == hf_name), None)

    def release_resident_pages(self) -> None:
        """Drop this process's resident pages of the file's mapping (``madvise(MADV_DONTNEED)``):
        once the load has packed the blocks it serves, the mapping is read again only where the
        embedding lookup reads its rows, and a page read again comes back from the page cache. The
        mapping is shared and read-only, so nothing is lost; RSS stops counting the whole file."""
        release = getattr(self.reader, "release_resident_pages", None)
        if release is not None:
            release()

    def field(self, key: str, default=None):
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def arch_field(self, key: str, default=None):
        return self.field(f"{self.architecture}.{key}", default)

    def config(self) -> dict:
        """The hyper-parameters as an HF ``config.json`` would hold them."""
        arch = self.architecture
        heads = self._required(f"{arch}.attention.head_count")
        hidden = self._required(f"{arch}.embedding_length")
        embed = self._by_name.get("token_embd.weight")
        if embed is None:
            raise ValueError(f"GGUF file {self.path.name} has no token_embd.weight")
        vocab = int(embed.shape[1])  # ne order: [hidden, vocab]
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
        head_dim = self.arch_field("attention.key_length") or hidden // heads
        cfg = {
            "architectures": [self.declaration.name],
            "vocab_size": vocab,
            "hidden_size": hidden,
            "intermediate_size": self._required(f"{arch}.feed_forward_length"),
            "num_hidden_layers": self._required(f"{arch}.block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self.arch_field("attention.head_count_kv") or heads,
            "head_dim": head_dim,
            "rms_norm_eps": float(self.arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self.arch_field("rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(head_dim),
            "max_position_embeddings": self.arch_field("context_length", 2048),
            "tie_word_embeddings": "output.weight" not in self._by_name,
            "attention_bias": "blk.0.attn_output.bias" in self._by_name,
            "eos_token_id": eos_ids,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
        }
        extra = self.declaration.gguf_config(self)
        return {**cfg, **{k: v for k, v in extra.items() if v is not None}}

    def _required(self, key: str):
        value = self.field(key)
        if value is None:
            raise ValueError(f"GGUF file {self.path.name} lacks the metadata key {key}")
        return value

    def _rope_scaling(self, head_dim: int) -> dict | None:
        factors = self._by_name.get("rope_freqs.weight")
        if factors is not None:  # Llama 3.1-style scaling, stored as per-frequency divisors
            values = np.asarray(factors.data, dtype=np.float32).reshape(-1)
            if values.size != head_dim // 2:
                raise ValueError(
                    f"GGUF tensor rope_freqs.weight has {values.size} factors; head_dim {head_dim} needs "
                    f"{head_dim // 2}"
                )
            return {"rope_type": "freq_factors", "factors": tuple(float(v) for v in values)}
        kind = self.arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind == "linear":
            return {"rope_type": "linear", "factor": float(self.arch_field("rope.scaling.factor"))}
        raise ValueError(f"GGUF file {self.path.name}: rope scaling {kind!r} is not supported (linear is)")

    def tensors(self) -> Iterator[GGUFTensor]:
        """Every weight under its HF name, in file order."""
        heads = self._required(f"{self.architecture}.attention.head_count")
        kv_heads = self.arch_field("attention.head_count_kv") or heads
        decl = self.declaration
        permute = decl.gguf_permuted_qk
        for t in self.reader.tensors:
            if t.name in _DERIVED:
                continue
            hf_name = hf_tensor_name(t.name, decl)
            if hf_name is None:
                raise ValueError(f"GGUF tensor {t.name} is not a weight the {self.architecture} family has")
            heads_to_undo = None
            if permute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
                heads_to_undo = heads if "q_proj" in hf_name else kv_heads
            yield GGUFTensor(
                t.name,
                hf_name,
                SUPPORTED_TYPES[t.tensor_type],
                tuple(int(n) for n in reversed(t.shape.tolist())),
                t,
                heads_to_undo,
                decl.norm_offset if _is_norm(hf_name) else 0.0,
            )


def _is_norm(hf_name: str) -> bool:
    return hf_name.endswith(("norm.weight", "layernorm.weight"))


def hf_tensor_name(gguf_name: str, decl=None) -> str | None:
    """The HF name of a GGUF tensor of architecture ``decl`` (default: the Llama family's names)."""
    if gguf_name in GLOBAL_GGUF_NAMES:
        return GLOBAL_GGUF_NAMES[gguf_name]
    names = (decl or archs.by_name("LlamaForCausalLM")).gguf_names
    m = _BLOCK.match(gguf_name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


@functools.cache
def _cached_reader(path: str, size: int, mtime_ns: int) -> GGUFReader:
    return _ValidatingReader(path)


def forget_readers() -> None:
    """Drop the cached readers (``_open_reader``): their parsed metadata is Python objects by the
    hundred thousand (Qwen2.5's 151,936 tokens and merges: about 250 MiB), needed only while a
    model is set up. A view of a file's mapping (the embedding lookup's blocks) keeps the mapping
    alive without them; a later reader of the file parses it again."""
    _cached_reader.cache_clear()


def _open_reader(path: Path):
    """One reader per file per process while a model is set up (spec and weights share it; the load
    forgets it once done: ``forget_readers``); parsing the metadata of a large vocabulary takes
    seconds, so it is done once a load."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"GGUF file {path} does not exist") from None
    try:
        return _cached_reader(str(path), st.st_size, st.st_mtime_ns)
    except ValueError as e:
        raise ValueError(f"GGUF file {path.name} is not readable: {e}") from e
    except (IndexError, TypeError, UnicodeDecodeError) as e:  # the reader's way of running off the end
        raise ValueError(f"GGUF file {path.name} is not readable (truncated or corrupt header): {e}") from e


class _ValidatingReader(CompactReader):
    """The gguf package's reader, with each tensor's type and byte range checked before it is
    mapped, so that a bad file's error names the tensor (the reader alone fails with a bare enum or
    reshape error). It also slices a plain ndarray view of the map: every field of a large
    vocabulary is a slice, and a ``np.memmap`` slice costs several times a plain one."""

    @property
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.memmap) -> None:
        self._plain = mapped.view(np.ndarray)  # shares the mapping, which it keeps alive
        self._mapping = getattr(mapped, "_mmap", None)

    def release_resident_pages(self) -> None:
        mapping = getattr(self, "_mapping", None)
        if mapping is not None and hasattr(mapping, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)

    def _build_tensors(self, start_offs, fields):
        end = len(self.data)
        for field in fields:
            _, name_data, _, dims, raw_dtype, offset = field.parts
            name = bytes(name_data).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_dtype[0]))
            except ValueError:
                raise ValueError(f"tensor {name} has unknown GGML type code {int(raw_dtype[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims.astype(np.int64)))
            if n % block:
                raise ValueError(f"tensor {name}: {n} elements is not a whole number of {qtype.name} blocks")
            first = int(start_offs + offset[0])
            last = first + n * type_size // block
            if last > end:
                raise ValueError(
                    f"tensor {name} is truncated: needs bytes {first}..{last}, the file ends at {end}"
                )
        super()._build_tensors(start_offs, fields)
