"""Decode rows grouped by context length, shared by the attention paths that pad a group to its
longest member (the torch reference and the CPU path)."""

from __future__ import annotations


def length_groups(rows: list[int], lens: list[int], max_waste: float = 1.25) -> list[list[int]]:
    """Decode rows in groups of similar context length: each group is padded to its longest
    member, and a group grows only while padding keeps its work within ``max_waste`` of the real."""
    groups: list[list[int]] = []
    total = 0
    for b in sorted(rows, key=lambda r: -lens[r]):
        if groups and lens[groups[-1][0]] * (len(groups[-1]) + 1) <= max_waste * (total + lens[b]):
            groups[-1].append(b)
            total += lens[b]
        else:
            groups.append([b])
            total = lens[b]
    return groups
