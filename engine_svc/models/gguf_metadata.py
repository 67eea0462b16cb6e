"""The gguf package's reader with its metadata's array fields read compactly: the package makes two
numpy arrays for every string of an array field (a vocabulary's tokens and merges) and one for every
number as it opens a file (Qwen2.5's 151,936 tokens and 151,387 merges: some 600,000 array objects,
469 MiB of Python objects at the parse's peak, and seconds); ``CompactReader`` records where each
element is and makes its arrays when it is read. ``fields``, ``parts``, ``data`` and ``contents()``
give what the package's reader gives (``tests/test_gguf.py``). No torch here: the gateway reads a
file's FIM ids with it (``tokenizer_svc/fim.py``), the engine its config (``gguf_checkpoint.py``)."""

from __future__ import annotations

import array
import struct
from collections.abc import Sequence

import numpy as np
from gguf import GGUFReader, GGUFValueType, ReaderField


class CompactReader(GGUFReader):
    """``GGUFReader`` whose array fields' element parts are ``_ArrayParts``, made on access."""

    def _build_fields(self, offs: int, count: int) -> int:
        """The package's ``_build_fields``, an array field's parts ``_ArrayParts``: the engine's
        load had made and freed them, leaving ~18 MiB of the interpreter's object arenas that a
        few survivors kept (docs/quantization.md)."""
        for _ in range(int(count)):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            name = str(bytes(kv_kdata), encoding="utf-8")
            head = [kv_klen, kv_kdata, raw_kv_type]
            compact = (
                self._array_field(orig_offs, offs, head, name)
                if raw_kv_type[0] == GGUFValueType.ARRAY
                else None
            )
            if compact is not None:
                size, field = compact
            else:
                size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
                field = ReaderField(orig_offs, name, head + parts, [i + len(head) for i in idxs], types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _array_field(self, orig_offs: int, offs: int, head: list, name: str):
        """``(bytes after the type code, field)`` of a one-level array of scalars or strings, its
        element parts made on access; None where the library's own parsing is kept (nested arrays,
        a file of the other byte order)."""
        raw_itype = self._get(offs, np.uint32)
        alen = self._get(offs + 4, np.uint64)
        n, start = int(alen[0]), offs + 12
        try:
            itype = GGUFValueType(int(raw_itype[0]))
        except ValueError:
            raise ValueError(f"metadata array {name} has unknown element type {int(raw_itype[0])}") from None
        if itype == GGUFValueType.ARRAY or self.byte_order != "I":
            return None
        head = head + [raw_itype, alen]
        data = memoryview(self.data)  # one buffer export, not one a string
        if itype == GGUFValueType.STRING:
            starts = array.array("q")
            at, end, unpack = start, len(data), struct.Struct("<Q").unpack_from
            for _ in range(n):
                if at + 8 > end:
                    raise IndexError(f"metadata array {name} runs past the end of the file")
                starts.append(at)
                at += 8 + unpack(data, at)[0]
            if at > end:
                raise IndexError(f"metadata array {name} runs past the end of the file")
            parts = _ArrayParts(head, n, 2, lambda j: self._get_str(starts[j]))
            size = at - offs
        else:
            values = self._get(start, self.gguf_scalar_to_np[itype], n)
            if len(values) != n:
                raise IndexError(f"metadata array {name} runs past the end of the file")
            parts = _ArrayParts(head, n, 1, lambda j: (values[j : j + 1],))
            size = 12 + int(values.nbytes)
        first = len(head) + parts.per - 1  # a string's bytes, a scalar's one-element array
        types = [GGUFValueType.ARRAY] + ([itype] if n else [])
        return size, ReaderField(
            orig_offs, name, parts, range(first, first + n * parts.per, parts.per), types
        )


class _ArrayParts(Sequence):
    """A metadata array field's ``parts`` as the library lays them out (the key's, the type's and
    the array's header parts, then ``per`` parts an element), each element's made when read."""

    def __init__(self, head: list, n: int, per: int, element):
        self.head, self.n, self.per, self._element = head, n, per, element

    def __len__(self) -> int:
        return len(self.head) + self.n * self.per

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i < len(self.head):
            return self.head[i]
        j, r = divmod(i - len(self.head), self.per)
        return self._element(j)[r]
