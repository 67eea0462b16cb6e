"""One decoder-only transformer, shaped by the architecture's declaration (``engine_svc/models/arch/``):
the Llama family (Llama 2/3, Mistral, Qwen2 with its qkv bias, Qwen3 with per-head q/k RMSNorm,
Phi-3 with its fused projections split at load), Gemma 3 (sandwich norms, GELU-tanh MLP, a sliding
window and a rotary table per layer kind, a scaled embedding) and Gemma 2 (Gemma 3's parts less the
q/k norms, plus soft-capped attention scores). Tokens of every request in a step are flattened
into one batch; attention reads and writes the paged KV cache through the ``kernels`` interface.

On the CPU, where every op of the layer loop is a native kernel, the loop runs in one native call
(``kernels/cpu/native_decoder.py``: the same kernels in the same order, the same bits); anything
else (wrapped projections, q/k norms, tensor parallelism, other kernels or devices) runs the
Python loop below."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine_svc.kv_groups import layout_of
from engine_svc.models import layer_progress
from engine_svc.models.rotary_tables import RotaryTables
from engine_svc.models.routed_experts import RoutedExperts
from engine_svc.models.spec import ModelSpec
from engine_svc.parallel.shard import Shard
from engine_svc.sampler import argmax_rows
from engine_svc.torch_modes import inference
from kernels.backend import Kernels
from kernels.cpu import native_decoder
from kernels.cpu.greedy_head import ChunkedArgmax
from kernels.cpu.linear import make_linear
from kernels.reference.kv_write import split_qkv
from kernels.reference.rotary import rotary_rows

log = logging.getLogger(__name__)
# Why a model with routed experts runs the Python layer loop: the native loop has no routed MLP
# (docs/architecture.md, "Routed experts"); each expert's GEMMs are native kernels all the same.
ROUTED_EXPERTS_REASON = "routed experts (mixture of experts): the native layer loop has no routed MLP"


@dataclass
class AttentionInputs:
    """Where each flattened token sits: see kernels/reference/paged_attention.py."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B+1] int32
    max_query_len: int
    max_seq_len: int
    # Several KV cache groups (engine_svc/kv_groups.py): every group's slots [G, T] and tables
    # [G, B, max_blocks] (slot_mapping and block_tables are group 0's); None with one group.
    group_slots: torch.Tensor | None = None
    group_tables: torch.Tensor | None = None

    def of_group(self, group: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot mapping, block tables) a layer of KV cache group ``group`` reads and writes
        (without group tables, group 0's: one table every layer reads, each with a cache of its own)."""
        if group == 0 or self.group_slots is None:
            return self.slot_mapping, self.block_tables
        return self.group_slots[group], self.group_tables[group]


class DecoderLayer(nn.Module):
    """Weights hold this rank's shard: its heads and MLP columns (all of them when unsharded).

    Norms: ``input_norm`` before attention, ``post_attn_norm`` before the MLP (HF Llama's
    ``post_attention_layernorm``; the declaration's ``mlp_norm`` slot), and with sandwich norms
    ``attn_out_norm`` / ``mlp_out_norm`` on the attention's and the MLP's outputs. A ``(1 + w)``
    norm holds ``1 + w`` (added at load), so every norm is the one RMSNorm kernel."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype, shard: Shard, index: int = 0):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.shard = shard
        self.num_heads, self.num_kv_heads, self.head_dim = shard.heads(spec), shard.kv_heads(spec), d
        qkv_rows = (self.num_heads + 2 * self.num_kv_heads) * d
        inter = shard.intermediate(spec)
        self.qkv_weight = nn.Parameter(torch.empty(qkv_rows, h, dtype=dtype), requires_grad=False)
        self.qkv_bias = (
            nn.Parameter(torch.zeros(qkv_rows, dtype=dtype), requires_grad=False) if spec.qkv_bias else None
        )
        self.o_weight = nn.Parameter(torch.empty(h, self.num_heads * d, dtype=dtype), requires_grad=False)
        self.o_bias = nn.Parameter(torch.zeros(h, dtype=dtype), requires_grad=False) if spec.o_bias else None
        self.q_norm = nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False) if spec.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(d, dtype=dtype), requires_grad=False) if spec.qk_norm else None
        experts = spec.layer_experts[index] if spec.layer_experts else None
        self.gelu = spec.activation == "gelu_tanh"  # else SiLU
        # The MLP: routed experts (a mixture-of-experts layer) or one dense gated MLP
        self.experts = None if experts is None else RoutedExperts(experts, h, dtype, self.gelu)
        dense = experts is None
        self.gate_up_weight = (
            nn.Parameter(torch.empty(2 * inter, h, dtype=dtype), requires_grad=False) if dense else None
        )
        self.down_weight = (
            nn.Parameter(torch.empty(h, inter, dtype=dtype), requires_grad=False) if dense else None
        )
        self.input_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False)
        sandwich = spec.sandwich_norms
        self.attn_out_norm = (
            nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False) if sandwich else None
        )
        self.mlp_out_norm = (
            nn.Parameter(torch.ones(h, dtype=dtype), requires_grad=False) if sandwich else None
        )
        self.eps = spec.rms_norm_eps
        self.scale = spec.attn_scale if spec.attn_scale is not None else d**-0.5
        kind = spec.layer_attention[index] if spec.layer_attention else None
        self.window = None if kind is None else kind.window  # sliding-window attention: its width
        self.softcap = spec.attn_logit_softcap  # the scores' tanh soft-cap (Gemma 2), or None
        self.kv_group = layout_of(spec).layer_group()[index]  # whose block table it reads
        self.rope_index = 0  # which of the model's rotary tables (set by the model)
        self.index = index  # this layer's place in the stack (LoRA wrappers read their stacks by it)
        self._kv_of, self._kv_views = None, ()
        self.prepare_linears("dense")

    def prepare_linears(self, backend: str, blocks=None) -> None:
        """Build the projections' GEMMs from the weights as loaded (``kernels.cpu.linear``), on the
        load's quantized blocks where ``blocks`` (``quantized_weights.QuantizedBlocks``) has them;
        call again after the weights change (then wrap them for LoRA again: ``lora.layers``). The
        loader then frees the parameters that a packed linear copied (``models/float_weights.py``).
        Called through the model's ``prepare_linears``, which invalidates its native loop."""
        blocks = blocks or {}
        key = f"layers.{self.index}."
        self.qkv_proj = make_linear(backend, self.qkv_weight, self.qkv_bias, blocks.get(key + "qkv_weight"))
        self.o_proj = make_linear(backend, self.o_weight, blocks=blocks.get(key + "o_weight"))
        if self.experts is not None:
            self.experts.prepare_linears(backend, blocks, key + "experts.")
            self.gate_up_proj = self.down_proj = None
            return
        gate_up = blocks.get(key + "gate_up_weight")
        self.gate_up_proj = make_linear(backend, self.gate_up_weight, blocks=gate_up)
        self.down_proj = make_linear(backend, self.down_weight, blocks=blocks.get(key + "down_weight"))

    def forward(self, k: Kernels, x, residual, positions, cos_sin, kv_cache, attn: AttentionInputs):
        x, residual = k.rms_norm(x, self.input_norm, self.eps, residual)
        x = self._attention(k, x, positions, cos_sin, kv_cache, attn)
        if self.attn_out_norm is not None:
            x = k.rms_norm(x, self.attn_out_norm, self.eps)[0]
        x, residual = k.rms_norm(x, self.post_attn_norm, self.eps, residual)
        if self.experts is not None:
            out = self.experts(k, x)  # unsharded: tensor parallelism refuses experts at start
        else:
            gate_up = self.gate_up_proj(x)
            h = k.gelu_tanh_and_mul(gate_up) if self.gelu else k.silu_and_mul(gate_up)
            out = self.shard.all_reduce(self.down_proj(h))
        if self.mlp_out_norm is not None:
            out = k.rms_norm(out, self.mlp_out_norm, self.eps)[0]
        return out, residual

    def _norm_qk(self, k: Kernels, qkv: torch.Tensor) -> torch.Tensor:
        """The fused q/k/v rows with every q head normed by ``q_norm`` and every k head by ``k_norm``
        (per-row kernels: a row's bits do not depend on the rows normed with it)."""
        t, d = qkv.shape[0], self.head_dim
        q, key, value = split_qkv(qkv, self.num_heads, self.num_kv_heads, d)
        q = k.rms_norm(q.reshape(-1, d), self.q_norm, self.eps)[0]
        key = k.rms_norm(key.reshape(-1, d), self.k_norm, self.eps)[0]
        return torch.cat([q.view(t, -1), key.view(t, -1), value.reshape(t, -1)], dim=1)

    def _cache_views(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The key and value halves of this layer's cache, made once per cache tensor rather than
        twice a step (each index of a tensor is a dispatch)."""
        if self._kv_of is not kv_cache:
            self._kv_of, self._kv_views = kv_cache, (kv_cache[0], kv_cache[1])
        return self._kv_views

    def _attention(self, k: Kernels, x, positions, cos_sin, kv_cache, attn: AttentionInputs):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        k_cache, v_cache = self._cache_views(kv_cache)
        if self.q_norm is not None:  # each head's q and k rows normed (the native loop: in place)
            qkv = self._norm_qk(k, qkv)
        # rotary and the cache write in one call on the fused rows
        heads = (self.num_heads, self.num_kv_heads)
        slots, tables = attn.of_group(self.kv_group)
        q = k.rotate_and_store(qkv, positions, cos_sin, k_cache, v_cache, slots, *heads)
        q_size = self.num_heads * self.head_dim
        # The window only where the layer has one: a kernel bundle without windows serves the rest.
        window = {} if self.window is None else {"window": self.window}
        if self.softcap is not None:  # likewise the soft-cap
            window["softcap"] = self.softcap
        out = k.paged_attention(
            q,
            k_cache,
            v_cache,
            tables,
            attn.seq_lens,
            attn.query_start_loc,
            self.scale,
            max_query_len=attn.max_query_len,
            max_seq_len=attn.max_seq_len,
            **window,
        )
        out = self.shard.all_reduce(self.o_proj(out.reshape(t, q_size)))
        return out if self.o_bias is None else out + self.o_bias  # the bias once, after the sum


class DecoderForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, dtype: torch.dtype, max_positions: int, shard: Shard | None = None):
        super().__init__()
        self.spec = spec
        self.shard = shard = shard or Shard()
        shard.check(spec)
        self.vocab_start, vocab_end = shard.vocab_range(spec)
        local_vocab = vocab_end - self.vocab_start
        self.embed = nn.Parameter(
            torch.empty(local_vocab, spec.hidden_size, dtype=dtype), requires_grad=False
        )
        self.layers = nn.ModuleList(DecoderLayer(spec, dtype, shard, i) for i in range(spec.num_layers))
        self.final_norm = nn.Parameter(torch.ones(spec.hidden_size, dtype=dtype), requires_grad=False)
        self.embed_blocks = None  # a BlockEmbedding once the load frees a GGUF table (float_weights.py)
        self._greedy_head = None  # greedy_tokens' slicer of the head it was built for
        # What flows between the ops; the load sets fp32 where the linears keep bf16/fp16 weights
        # (model_setup.py), and the embedding table stays 16-bit: its lookup widens the rows it reads.
        self.activation_dtype = dtype
        self.lm_head = (
            None
            if spec.tie_word_embeddings
            else nn.Parameter(torch.empty(local_vocab, spec.hidden_size, dtype=dtype), requires_grad=False)
        )
        # One rotary table per kind of layer (a Llama: one; Gemma 3: local and global), the first
        # layer's first: ``cos_sin`` (the native loop's), then ``cos_sin_1``, ...
        # With a rotary switch (long-rope: a sequence past it is rotated whole by another table),
        # each table holds a block of rows per phase and the runner passes each token's row
        # (``rotary_rows``) as its position; a kind without phases repeats its rows.
        # On the CPU a table's rows are written as positions are reached (``RotaryTables``: the
        # forward covers the step's positions first), the same values as the whole table's.
        kinds = spec.layer_attention or ()
        self.max_positions, self.rope_switch = max_positions, spec.rope_switch if kinds else None
        keys: list[tuple] = []
        declared: list[tuple] = []
        for layer, kind in zip(self.layers, kinds, strict=True):
            if kind.rope_key() not in keys:
                keys.append(kind.rope_key())
                declared.append((spec.head_dim, kind.rope_theta, kind.rope_scaling))
            layer.rope_index = keys.index(kind.rope_key())
        if not keys:  # a spec made without its declaration's layers
            declared.append((spec.head_dim, spec.rope_theta, spec.rope_scaling))
        lazy = torch.empty(0).device.type == "cpu"
        self.rotary = RotaryTables(declared, max_positions, 1 if self.rope_switch is None else 2, lazy)
        for i, table in enumerate(self.rotary.tables):
            self.register_buffer("cos_sin" if i == 0 else f"cos_sin_{i}", table, persistent=False)
        self.rotary.tables = []  # the module's buffers are the tables from here on
        self.num_rope_tables = len(declared)
        self.linear_backend = "dense"
        self.prepare_linears("dense")

    # The native loop's descriptors hold raw pointers into the layers' linears and tensors, so
    # they are built once over the weights as they stand (``finalize``) and dropped by every change
    # to them (``invalidate``): new linears (``prepare_linears``), wrapped ones (LoRA), a
    # parameter's storage swapped (``param.data = t``, as ``float_weights`` frees them), a dtype or
    # device move (``_apply``). In-place writes keep the pointers: the loop reads the new values.
    def finalize(self) -> None:
        """Build the native layer loop over the weights as they are now (or say why it cannot run:
        ``native_loop_reason``). Called once the load is done; a forward after an ``invalidate``
        calls it again."""
        self._build_native_loop()
        self._finalized = True

    def invalidate(self) -> None:
        """The weights changed (any path that changes what a layer holds calls this): the native
        loop's descriptors are dropped and built again by the next ``finalize``."""
        self._native_loop, self._finalized = None, False
        self.native_loop_reason = "not finalized since the weights changed"

    def _apply(self, *args, **kwargs):  # .to(), .float(), ...: every tensor may be new
        self.invalidate()
        self.cover_rotary(self.max_positions)  # a moved table is whole
        return super()._apply(*args, **kwargs)

    def cover_rotary(self, positions: int) -> None:
        """Make the rotary tables' rows of positions ``0 .. positions`` (every phase) readable."""
        if self.rotary.covered < positions:
            self.rotary.cover(self.rope_tables(), positions)

    def _cover_step(self, positions: torch.Tensor) -> None:
        """Cover the rows a step reads: ``positions`` are table rows (``rotary_rows``)."""
        if self.rotary.covered >= self.max_positions or not positions.numel():
            return
        if positions.device.type != "cpu":
            self.cover_rotary(self.max_positions)
            return
        rows = positions if self.rope_switch is None else positions % self.max_positions
        self.cover_rotary(int(rows.max()) + 1)

    def prepare_linears(self, backend: str, blocks=None, after_layer=None) -> None:
        """``"native"`` or ``"onednn"`` (weights packed once) or ``"dense"`` (``F.linear``) for every
        projection and the LM head, on the quantized blocks the load made or kept for them
        (``blocks``: ``quantized_weights.QuantizedBlocks``, by ``linear_weights`` key); called by
        ``model_setup.load_model`` once the weights are in place, which frees each layer's float
        weights its packed linears copied as soon as they are built (``after_layer(index)``, then
        ``after_layer(None)`` for the LM head)."""
        self.invalidate()
        for i, layer in enumerate(self.layers):
            layer.prepare_linears(backend, blocks)
            if after_layer is not None:
                after_layer(i)
        head = self.embed if self.lm_head is None else self.lm_head
        self.lm_head_proj = make_linear(backend, head, blocks=(blocks or {}).get("lm_head"))
        if after_layer is not None:
            after_layer(None)
        self.linear_backend = backend

    @inference
    def forward(
        self,
        k: Kernels,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn: AttentionInputs,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm. ``positions``: each token's row of
        the rotary tables (its position; with a rotary switch, ``rotary_rows``)."""
        x = self._embed(input_ids)
        self._cover_step(positions)
        if not self._finalized:
            self.finalize()
        if self._native_loop is not None:
            out = self._native_loop.run(k, x, positions, kv_caches, attn)
            if out is not None:
                return out
        residual = None
        tables = self.rope_tables()
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            # forward, not __call__: nn.Module's hook dispatch costs microseconds a layer, and
            # nothing hooks a layer (LoRA wraps its projections).
            cos_sin = tables[layer.rope_index]
            x, residual = layer.forward(k, x, residual, positions, cos_sin, kv_cache, attn)
            layer_progress.bump()  # the watchdog's sign that a long step is not hung
        x, _ = k.rms_norm(x, self.final_norm, self.spec.rms_norm_eps, residual)
        return x

    def rotary_rows(self, positions, lengths):
        """Each token's row of the rotary tables, from its position and its sequence's length
        (tokens, prompt and outputs, at this step); the positions themselves without a switch."""
        if self.rope_switch is None:
            return positions
        return rotary_rows(positions, lengths, self.rope_switch, self.max_positions)

    def rope_tables(self) -> list[torch.Tensor]:
        return [self.cos_sin, *(getattr(self, f"cos_sin_{i}") for i in range(1, self.num_rope_tables))]

    def _build_native_loop(self) -> None:
        """The native layer loop over the layers as they are now, or the reason it cannot run them."""
        self._native_loop, reason = None, None
        first = self.layers[0] if len(self.layers) else None
        if self.shard.size != 1:
            reason = "tensor parallel"
        elif first is None:
            reason = "no layers"
        elif any(layer.eps != self.spec.rms_norm_eps or layer.scale != first.scale for layer in self.layers):
            reason = "layers differ in eps or scale"
        elif any(layer.experts is not None for layer in self.layers):
            reason = ROUTED_EXPERTS_REASON
        else:
            shape = native_decoder.Shape(
                hidden=self.spec.hidden_size,
                q_heads=first.num_heads,
                kv_heads=first.num_kv_heads,
                head_dim=first.head_dim,
                inter=first.shard.intermediate(self.spec),  # the weights may be freed (float_weights)
                eps=self.spec.rms_norm_eps,
                scale=first.scale,
                gelu=first.gelu,
            )
            tables = self.rope_tables()
            parts = [
                native_decoder.LayerParts(
                    layer.qkv_proj,
                    layer.o_proj,
                    layer.gate_up_proj,
                    layer.down_proj,
                    layer.input_norm,
                    layer.post_attn_norm,
                    layer.o_bias,
                    layer.q_norm,
                    layer.k_norm,
                    layer.attn_out_norm,
                    layer.mlp_out_norm,
                    None if layer.rope_index == 0 else tables[layer.rope_index],
                    layer.window,
                    layer.kv_group,
                    layer.softcap,
                )
                for layer in self.layers
            ]
            built = native_decoder.build(shape, parts, self.final_norm, self.cos_sin, layer_progress.ADDRESS)
            if isinstance(built, str):
                reason = built
            else:
                self._native_loop = built
        if reason == ROUTED_EXPERTS_REASON and self.native_loop_reason != reason:
            log.info("layer loop: Python (%s)", reason)
        self.native_loop_reason = reason

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self._lookup(input_ids)
        if self.spec.embed_scale is not None:  # as HF: the scale as a tensor of the embedding's dtype
            x = x * torch.tensor(self.spec.embed_scale, dtype=x.dtype, device=x.device)
        return x

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.embed_blocks is not None:  # unsharded only
            return self.embed_blocks(input_ids)
        if self.shard.size == 1:
            return F.embedding(input_ids, self.embed).to(self.activation_dtype)
        # Vocabulary-parallel: each rank looks up the ids it holds, zeros elsewhere, then a sum.
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.embed.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.embed).masked_fill(outside[:, None], 0.0)
        return self.shard.all_reduce(x.to(self.activation_dtype))

    @inference
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.shard.all_gather_last_dim(self.lm_head_proj(hidden).float())
        return self._softcap(logits)

    def _softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.spec.final_logit_softcap
        if cap is not None:  # as HF: logits / cap, tanh, times cap
            logits = torch.tanh(logits / cap) * cap
        return logits

    @inference
    def greedy_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """``sampler.argmax_rows(self.compute_logits(hidden))``, the same indices; on the CPU with
        an int8-activation or native (fp32 / bf16 / fp16) head, a vocabulary slice at a time
        (kernels/cpu/greedy_head.py): the whole ``[rows, vocab]`` logits are never written. Not
        with a logit soft-cap (torch's tanh is not promised the same bits on a slice as on the
        whole row), nor sharded."""
        chunked = None
        if self.shard.size == 1 and hidden.is_cpu and self.spec.final_logit_softcap is None:
            head = self.lm_head_proj
            if self._greedy_head is None or self._greedy_head.linear is not head:
                self._greedy_head = ChunkedArgmax.of(head) or _NoChunks(head)
            chunked = self._greedy_head
        if chunked is None or isinstance(chunked, _NoChunks):
            return argmax_rows(self.compute_logits(hidden))
        return torch.from_numpy(chunked(hidden))


class _NoChunks:
    """``greedy_tokens``' note that this head has no sliced path (its logits are taken whole)."""

    def __init__(self, linear):
        self.linear = linear
