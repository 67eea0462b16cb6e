"""torch's inference mode around the step's entry points, entered once per step.

``@torch.inference_mode()`` builds and enters a fresh context object on every call (a few
microseconds each); a step nests four such calls (the runner's execute and forward, the model's
forward and logits). ``inference`` enters the mode only where the caller is not already inside
it, so a step pays once. Parameters never require grad (models/decoder.py), so the mode is a
guard, not what keeps autograd out of a step."""

from __future__ import annotations

import functools

import torch


def inference(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run
