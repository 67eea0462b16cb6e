"""A layer's routed experts (Qwen3-MoE, Mixtral): the MLP of a mixture-of-experts layer, built from
the declaration's ``Experts`` (engine_svc/models/arch/).

One step's tokens go through it as: the router's GEMM (``[T, E]`` logits), a softmax in fp32 over
the E experts, the k largest (ties to the lower expert index, ``torch.topk``), renormalised by
their sum when the rule says so; then the k copies of each token grouped by expert in one fixed
order (expert index, then token, then rank: a stable sort of the flat choices); per expert one
gate/up GEMM over its rows, the gated activation, one down GEMM; each token's k outputs scaled by
its weights and summed in rank order.

A token's result is bitwise the same whatever shares its step: every GEMM here is the engine's
(a native GEMM gives each row one order of arithmetic whatever the row count, so an expert's row
does not change with how many other rows it received), the softmax and top-k work on one row at a
time, the gathering and scattering are copies, and the sum over the k experts is an explicit
sequence of elementwise adds in rank order (never a scatter-add or a reduction whose order depends
on the batch).

Each expert's projections are linears of their own (``kernels.cpu.linear.make_linear``), so a GGUF
file's stacked experts are served from each expert's row range of the 3-D tensor by the quantized
GEMMs (``models/quantized_weights.py``), and the float parameters are freed once packed
(``models/float_weights.py``), as for the dense projections.
"""

from __future__ import annotations

import torch
from torch import nn

from engine_svc.models.arch import Experts
from kernels.backend import Kernels
from kernels.cpu.linear import make_linear


class RoutedExperts(nn.Module):
    def __init__(self, experts: Experts, hidden: int, dtype: torch.dtype, gelu: bool = False):
        super().__init__()
        count, inter = experts.count, experts.intermediate_size
        self.count, self.top_k, self.inter = count, experts.top_k, inter
        self.renormalize = experts.renormalize
        self.gelu = gelu
        empty = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)  # noqa: E731
        self.router_weight = empty(count, hidden)
        # per expert: its gate rows then its up rows ([2 * inter, hidden]) and its down projection
        self.gate_up_weights = nn.ParameterList(empty(2 * inter, hidden) for _ in range(count))
        self.down_weights = nn.ParameterList(empty(hidden, inter) for _ in range(count))
        self.prepare_linears("dense")

    def prepare_linears(self, backend: str, blocks=None, prefix: str = "") -> None:
        """``blocks``: the load's quantized blocks by ``quantized_weights.linear_weights`` key, the
        experts' under ``prefix`` (``layers.{i}.experts.``)."""
        blocks = blocks or {}
        self.router = make_linear(backend, self.router_weight)
        self.gate_up_projs = [
            make_linear(backend, w, blocks=blocks.get(f"{prefix}{e}.gate_up_weight"))
            for e, w in enumerate(self.gate_up_weights)
        ]
        self.down_projs = [
            make_linear(backend, w, blocks=blocks.get(f"{prefix}{e}.down_weight"))
            for e, w in enumerate(self.down_weights)
        ]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` fp32, expert indices ``[T, k]``), ranks in descending weight."""
        probs = torch.softmax(self.router(x).float(), dim=-1)
        weights, index = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:  # the sum in rank order, one elementwise add at a time
            total = weights[:, 0]
            for r in range(1, self.top_k):
                total = total + weights[:, r]
            weights = weights / total[:, None]
        return weights, index

    def forward(self, k: Kernels, x: torch.Tensor) -> torch.Tensor:
        t, hidden = x.shape
        weights, index = self.route(x)
        flat = index.reshape(-1)  # token-major: token i's rank r at i * k + r
        order = torch.argsort(flat, stable=True)  # by expert, then token, then rank
        counts = torch.bincount(flat, minlength=self.count).tolist()
        rows = x.index_select(0, order // self.top_k)
        out = x.new_empty(t * self.top_k, hidden)
        start = 0
        for e, n in enumerate(counts):
            if n:
                gate_up = self.gate_up_projs[e](rows[start : start + n])
                h = k.gelu_tanh_and_mul(gate_up) if self.gelu else k.silu_and_mul(gate_up)
                out.index_copy_(0, order[start : start + n], self.down_projs[e](h))
            start += n
        out = out.view(t, self.top_k, hidden)
        weights = weights.to(x.dtype)
        acc = out[:, 0] * weights[:, 0:1]
        for r in range(1, self.top_k):
            acc = acc + out[:, r] * weights[:, r : r + 1]
        return acc
