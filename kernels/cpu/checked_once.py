"""What a native kernel reads unchecked through raw pointers is checked in Python first; every layer
of a step passes the same metadata tensors, so those checks run once per step, not once per layer.
``CheckedOnce`` remembers the tensors last checked (weak references: a new step's tensor is never
mistaken for the last one's) with their version and the bounds they were checked against, and what
was made from them (a kernel's metadata arguments)."""

from __future__ import annotations

import weakref

import torch


class CheckedOnce:
    def __init__(self) -> None:
        self.refs: tuple = ()
        self.bounds: tuple = ()
        self.payload = None  # what the checker made from the tensors, reused while they are seen

    def seen(self, *tensors: torch.Tensor, bounds: tuple = ()) -> bool:
        return (
            len(self.refs) == len(tensors)
            and self.bounds == bounds
            and all(r() is t and v == _version(t) for (r, v), t in zip(self.refs, tensors, strict=True))
        )

    def remember(self, *tensors: torch.Tensor, bounds: tuple = (), payload=None) -> None:
        self.refs = tuple((weakref.ref(t), _version(t)) for t in tensors)
        self.bounds, self.payload = bounds, payload


def _version(t: torch.Tensor) -> int | None:
    """In-place changes bump it (checked again); inference tensors keep none (identity alone)."""
    return None if t.is_inference() else t._version
