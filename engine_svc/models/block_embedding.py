"""The token-embedding lookup on a GGUF file's own blocks: a tied model whose LM head runs on packed
blocks would otherwise keep the whole table dequantized to fp32 for the lookup alone (SmolLM2-135M:
108 MiB, against 30 MiB of Q8_0 blocks). A lookup dequantizes only the rows it reads, with
``QuantizedWeight.dequantize``, so its rows are the float table's bit for bit where the table was
that dequantization (``from_table`` checks it; a table quantized at load from float weights is not).

Where the blocks carry the file's own bytes (``QuantizedWeight.raw``: a view of the file's mapping,
as the loader attaches them), the lookup keeps only those and reads a row's blocks there with the
loader's reader (``quant_gemm.from_gguf_blocks``): no copy at all, the mapping's pages resident as
rows are read (Qwen2.5-Coder-1.5B's Q4_K table: 131 MiB in the file, against 250 MiB as a byte a
quant with fp16 scales). Otherwise it keeps the quants a byte each and the scales as fp16 where
they are fp16 values.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cpu.quant_gemm import QuantizedWeight, from_gguf_blocks

_CHECK_ROWS = 4096  # rows dequantized at a time by the check (bounds its extra memory)


class BlockEmbedding:
    """``F.embedding(ids, table)`` where ``table`` is ``blocks.dequantize()``."""

    def __init__(self, blocks: QuantizedWeight):
        self._fmt = blocks.fmt
        self.num_embeddings, self.embedding_dim = blocks.shape
        self._raw = blocks.raw
        if self._raw is not None:
            if self._raw.shape[0] != self.num_embeddings:
                raise ValueError(
                    f"the file's blocks hold {self._raw.shape[0]} rows, the table {blocks.shape}"
                )
            self._q = self._d = self._m = None
            return
        # fp16 scales where they are fp16 values (a GGUF file's are): read back exactly.
        d, m = blocks.d, blocks.m
        half = all(t is None or torch.equal(t.half().float(), t) for t in (d, m))
        self._q = blocks.q.contiguous()
        self._d = d.half() if half else d
        self._m = None if m is None else (m.half() if half else m)

    @property
    def nbytes(self) -> int:
        """The bytes it holds (the file's, for a lookup on its mapping)."""
        if self._raw is not None:
            return self._raw.nbytes
        return sum(t.numel() * t.element_size() for t in (self._q, self._d, self._m) if t is not None)

    @property
    def reads_the_file(self) -> bool:
        return self._raw is not None

    def rows(self, index) -> torch.Tensor:
        """fp32 rows ``index`` (a slice or a 1-D index tensor)."""
        if self._raw is not None:
            raw = self._raw[index.numpy()] if isinstance(index, torch.Tensor) else self._raw[index]
            raw = np.ascontiguousarray(raw)
            return from_gguf_blocks(self._fmt, raw, (raw.shape[0], self.embedding_dim)).dequantize()
        if isinstance(index, torch.Tensor):
            # index_select, not ``t[index]``: torch's advanced indexing reads the whole table on CPU
            # (20 ms for 32 rows of SmolLM2's, against 5 us).
            q, d = self._q.index_select(0, index), self._d.index_select(0, index)
            m = None if self._m is None else self._m.index_select(0, index)
        else:
            q, d, m = self._q[index], self._d[index], None if self._m is None else self._m[index]
        return QuantizedWeight(self._fmt, q, d.float(), None if m is None else m.float()).dequantize()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            bad = flat[(flat < 0) | (flat >= self.num_embeddings)][0]
            # F.embedding's error type; a negative id would otherwise index from the end
            raise IndexError(f"token id {int(bad)} is outside the embedding's {self.num_embeddings} rows")
        return self.rows(flat).view(*ids.shape, self.embedding_dim)


def from_table(table: torch.Tensor | None, blocks: QuantizedWeight | None) -> BlockEmbedding | None:
    """A lookup on ``blocks`` if they reproduce ``table`` bit for bit (fp32), else None. ``table``
    None: the load never read it (``quantized_weights.served_by_blocks``), so the file's blocks are
    the table by definition (its dequantization is the loader's, ``GGUFTensor.dequantize``, bit
    for bit: tests/test_gguf.py) and nothing is checked."""
    if blocks is None:
        return None
    if table is None:
        return BlockEmbedding(blocks)
    if table.dtype != torch.float32 or tuple(table.shape) != blocks.shape:
        return None
    lookup = BlockEmbedding(blocks)
    bits = table.view(torch.int32)
    for start in range(0, table.shape[0], _CHECK_ROWS):
        part = slice(start, start + _CHECK_ROWS)
        if not torch.equal(lookup.rows(part).view(torch.int32), bits[part]):
            return None
    return lookup
