"""An op and the layer after it as one kernel, beneath model code that calls them one by one.

The model files call their layers as transformers' and vLLM's model files do, one at a time:

    hidden_states, residual = self.input_layernorm(hidden_states, residual)
    hidden_states = self.self_attn(positions, hidden_states)   # starts with qkv_proj(...)
        q, k = self.q_norm(q), self.k_norm(k)                   # Qwen3
        q, k = self.rotary_emb(positions, q, k)
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
    hidden_states = self.mlp(hidden_states)  # down_proj(act_fn(gate_up_proj(...)))

A decode step at batch 1 is bound by kernel launches, not by math: on an H200 each of its
~310 kernels costs ~3 us. Some ops touch one row each and feed a single layer whose kernel
reads all of that input anyway, so on a GPU that kernel applies the op as it loads it:

    op                         next layer     one kernel (kernels/fused_ops.py)  when
    input_layernorm            qkv_proj       rms_norm_skinny_gemm               the matmul is a
    post_attention_layernorm   gate_up_proj   rms_norm_skinny_gemm               skinny_gemm (a
    act_fn (SiLU and mul)      down_proj      silu_and_mul_skinny_gemm           GPU, 1-4 rows)
    q_norm, k_norm             rotary_emb     kernels.norm_rope (q and k)        on a GPU
    rotary_emb (+ the norms)   attn's store   norm_rope_store_kvcache            a GPU, a cache

The layers themselves (layers/layernorm.py, activation.py, rotary_embedding.py, linear.py,
attention.py) know nothing of this. It is applied in three steps:

1. Once, when a model is built on a GPU (worker/model_loading.py), ``fuse_layer_ops(model)``
   finds these pairs by their checkpoint names (FUSED_PAIRS) and turns both modules of each
   into their fused variants below (FUSED_VARIANTS: the class of the module is swapped for a
   subclass, as torch.nn.utils.parametrize does; parameters, buffers and names stay). Each op
   is handed its next layer's ``fuses(x)``: whether that layer's fused kernel will run for x.
2. At each call the op asks. If the answer is yes, it computes nothing and returns what is
   left to do, its input and its weights: a NormedInput (RMSNorm) or a GatedInput
   (SiluAndMul). Otherwise it computes its output as the plain layer does.
3. The next layer, handed one of those, runs its fused kernel (FusedLinear.forward,
   FusedRowParallelLinear.forward, FusedRotaryEmbedding.forward, FusedAttention.forward).

RoPE defers too, to the attention layer, whose first act is to store k and v in the paged
cache: rotary_emb returns two RotaryInputs (q and k still to normalise and rotate), and
FusedAttention.forward runs norm_rope_store_kvcache, which rotates them and writes the rotated
k and v at the step's slots in the same launch, instead of its own store_kvcache. It defers
only where there is a cache to write (not in a warm-up forward before the cache is sized).

An RMSNorm with a residual also returns the new residual stream, x + residual. When it defers,
that tensor is allocated here, empty, and the fused kernel writes it; nothing reads it before:
its reader is the next norm.

Everywhere else (prefill, larger batches, a layer with a bias) no op defers, so the layers run
one after the other and compute exactly what the model file says; a model built on a CPU is
never fused, so nothing here runs there. A pair is listed only where the op's output goes to
that one layer and nowhere else, as it does in every model here; Qwen3-MoE's
post_attention_layernorm feeds a router and the experts, not a gate_up_proj, so in its sparse
layers the norm always runs on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from myvllm.kernels import is_batch_invariant, norm_rope, use_triton, uses_skinny_gemm
from myvllm.kernels.fused_ops import (norm_rope_store_kvcache, rms_norm_skinny_gemm,
                                      silu_and_mul_skinny_gemm)
from myvllm.layers.activation import SiluAndMul
from myvllm.layers.attention import Attention
from myvllm.layers.layernorm import RMSNorm
from myvllm.layers.linear import (LinearBase, MergedColumnParallelLinear, QKVParallelLinear,
                                  RowParallelLinear)
from myvllm.layers.rotary_embedding import RotaryEmbedding
from myvllm.utils.context import get_context
from myvllm.utils.distributed import all_reduce

# (op, next layer), as module names under the module that holds both.
FUSED_PAIRS: tuple[tuple[str, str], ...] = (
    ("input_layernorm", "self_attn.qkv_proj"),     # in a DecoderLayer
    ("post_attention_layernorm", "mlp.gate_up_proj"),
    ("act_fn", "down_proj"),                       # in a GatedMLP
    ("q_norm", "rotary_emb"),                      # in Qwen3's attention
    ("k_norm", "rotary_emb"),
    ("rotary_emb", "attn"),                        # in every model's attention
)


class DeferredInput:
    """The input of a matmul with the op before it still to do, inside the matmul's kernel."""

    def matmul(self, weight: torch.Tensor) -> torch.Tensor:
        """op(input) @ weight^T, in one kernel."""
        raise NotImplementedError


@dataclass(eq=False)
class NormedInput(DeferredInput):
    """rms_norm(x + residual) with this weight and eps (rms_norm(x) when residual is None), not
    computed yet. residual_out: where the kernel writes the new residual stream x + residual."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None = None
    residual_out: torch.Tensor | None = None

    def matmul(self, weight: torch.Tensor) -> torch.Tensor:
        if self.residual is None:
            return rms_norm_skinny_gemm(self.x, self.weight, self.eps, weight)
        out, _ = rms_norm_skinny_gemm(self.x, self.weight, self.eps, weight, self.residual,
                                      self.residual_out)  # fmt: skip
        return out


@dataclass(eq=False)
class GatedInput(DeferredInput):
    """silu(gate) * up for gate_up = [gate | up], not computed yet."""

    gate_up: torch.Tensor

    def matmul(self, weight: torch.Tensor) -> torch.Tensor:
        return silu_and_mul_skinny_gemm(self.gate_up, weight)


@dataclass(eq=False)
class RotaryInput:
    """RoPE of x [N, H, D] at positions (after a per-head RMSNorm with norm_weight and eps when
    norm_weight is given), not computed yet: the attention layer's store does it."""

    x: torch.Tensor
    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    norm_weight: torch.Tensor | None
    eps: float


class FusableOp(nn.Module):
    """The first base of a fused op (an RMSNorm, SiluAndMul, RotaryEmbedding whose work the
    layer after it can do in its own kernel). fuse() sets next_layer_fuses to that layer's
    fuses(x): whether, for input x, its kernel applies this op."""

    next_layer_fuses: Callable[[torch.Tensor], bool] | None = None

    def defers_to_next_layer(self, x: torch.Tensor) -> bool:
        """Whether the next layer's kernel applies this op to x: then the op computes nothing
        and hands on what is left to do."""
        return self.next_layer_fuses is not None and self.next_layer_fuses(x)


# The fused ops widen what their forward returns (a NormedInput, GatedInput or RotaryInput
# where they defer; hence the type: ignore[override]): only the fused next layer, which takes
# them, ever sees one, so the plain signatures stay what a model file reads.
class FusedRMSNorm(FusableOp, RMSNorm):
    def forward(  # type: ignore[override]
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | NormedInput | tuple[torch.Tensor | NormedInput, torch.Tensor]:
        if self.defers_to_next_layer(x):  # the next layer's kernel computes the norm
            return defer_rms_norm(x, self.weight, self.eps, residual)
        return super().forward(x, residual)


class FusedSiluAndMul(FusableOp, SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor | GatedInput:  # type: ignore[override]
        if self.defers_to_next_layer(x):  # down_proj's kernel applies it
            return GatedInput(x)
        return super().forward(x)


class FusedRotaryEmbedding(FusableOp, RotaryEmbedding):
    """RoPE that normalises each head first where q_norm and k_norm left it their work, and
    leaves the rotation to the attention layer's store where that can take it."""

    def forward(  # type: ignore[override]
        self, positions: torch.Tensor, q: torch.Tensor | NormedInput, k: torch.Tensor | NormedInput
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[RotaryInput, RotaryInput]:
        q, k, q_weight, k_weight, eps = take_head_norms(q, k)
        n = positions.shape[0]
        q_heads, k_heads = q.view(n, -1, self.head_dim), k.view(n, -1, self.head_dim)
        if self.defers_to_next_layer(q):
            return defer_rope(q_heads, k_heads, positions, self.cos_sin_cache, q_weight,
                              k_weight, eps)  # fmt: skip
        q_out, k_out = norm_rope(q_heads, k_heads, positions, self.cos_sin_cache, q_weight,
                                 k_weight, eps)  # fmt: skip
        return q_out.view(q.shape), k_out.view(k.shape)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether the rotation of x runs in Triton, whose kernel can normalise each head first
        (Qwen3's q_norm, k_norm)."""
        return use_triton(x)


class FusedAttention(Attention):
    """Attention whose store also rotates q and k where RoPE left them to it."""

    def forward(self, q: torch.Tensor | RotaryInput, k: torch.Tensor | RotaryInput,
                v: torch.Tensor) -> torch.Tensor:
        if not (isinstance(q, RotaryInput) or isinstance(k, RotaryInput)):
            return super().forward(q, k, v)
        context = get_context()
        n = v.shape[0]
        v = v.view(n, self.num_kv_heads, self.head_dim)
        # RoPE and the store in one kernel -> q, k [N, H, D], the cache written.
        q, k = rotate_and_store(q, k, v, self.k_cache, self.v_cache, context.slot_mapping,
                                self.k_scale, self.v_scale)  # fmt: skip
        return self.attend(q, k, v, context)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether RoPE, for input x, can leave its work to this layer's store, whose kernel
        then rotates q and k too: a Triton store with a cache to write."""
        has_slots = get_context().slot_mapping is not None
        return use_triton(x) and self.k_cache.numel() > 0 and has_slots


class FusedLinear(LinearBase):
    """A linear layer that applies the op before it (an RMSNorm, SiLU-and-mul) as its matmul
    kernel loads the input, where that op deferred (the first base of the three below)."""

    def forward(self, x: torch.Tensor | DeferredInput) -> torch.Tensor:
        if isinstance(x, DeferredInput):
            return x.matmul(self.weight)  # no bias: fuses() says so
        return super().forward(x)

    def fuses(self, x: torch.Tensor) -> bool:
        """Whether this layer's matmul for input x is a skinny_gemm, whose kernel can apply the
        op before it as it loads x."""
        return uses_skinny_gemm(x, self.weight, self.bias)


class FusedQKVParallelLinear(FusedLinear, QKVParallelLinear):
    pass


class FusedMergedColumnParallelLinear(FusedLinear, MergedColumnParallelLinear):
    pass


class FusedRowParallelLinear(FusedLinear, RowParallelLinear):
    def forward(self, x: torch.Tensor | DeferredInput) -> torch.Tensor:
        if not isinstance(x, DeferredInput):
            return super().forward(x)
        y = x.matmul(self.weight)  # no bias: fuses() says so
        if self.tp_size > 1:  # as RowParallelLinear.forward
            y = all_reduce(y, in_rank_order=is_batch_invariant())
        return y


# Each plain class that takes part in a pair -> its fused variant.
FUSED_VARIANTS: dict[type[nn.Module], type[nn.Module]] = {
    RMSNorm: FusedRMSNorm,
    SiluAndMul: FusedSiluAndMul,
    RotaryEmbedding: FusedRotaryEmbedding,
    Attention: FusedAttention,
    QKVParallelLinear: FusedQKVParallelLinear,
    MergedColumnParallelLinear: FusedMergedColumnParallelLinear,
    RowParallelLinear: FusedRowParallelLinear,
}


def take_head_norms(
    q: torch.Tensor | NormedInput, k: torch.Tensor | NormedInput
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, float]:
    """RoPE's input: (q, k, q_norm's weight, k_norm's weight, eps); the weights are None (eps
    0) unless q_norm and k_norm left their work to RoPE's kernel (two NormedInputs)."""
    if isinstance(q, NormedInput) and isinstance(k, NormedInput) and q.eps == k.eps:
        return q.x, k.x, q.weight, k.weight, q.eps
    if isinstance(q, NormedInput) or isinstance(k, NormedInput):
        raise ValueError("RotaryEmbedding: q_norm and k_norm are fused into it together, "
                         "with one eps")  # fmt: skip
    return q, k, None, None, 0.0


def defer_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
) -> tuple[RotaryInput, RotaryInput]:
    """What RoPE returns when the attention layer's store rotates q and k [N, H, D]."""
    return (RotaryInput(q, positions, cos_sin_cache, q_weight, eps),
            RotaryInput(k, positions, cos_sin_cache, k_weight, eps))  # fmt: skip


def rotate_and_store(
    q: torch.Tensor | RotaryInput, k: torch.Tensor | RotaryInput, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor | None,
    k_scale: float, v_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (RotaryInputs) rotated, [N, H, D] each, and k and v [N, Hkv, D] written into
    the caches at slot_mapping as store_kvcache writes them, in one kernel."""
    if not (isinstance(q, RotaryInput) and isinstance(k, RotaryInput)):
        raise TypeError("rotate_and_store: RoPE leaves q and k to the attention layer together")
    if slot_mapping is None or k_cache.numel() == 0:
        raise RuntimeError("rotate_and_store: RoPE was left to the KV store, but this step has "
                           "no cache or no slot_mapping to write to")
    return norm_rope_store_kvcache(q.x, k.x, v, q.positions, q.cos_sin_cache, k_cache, v_cache,
                                   slot_mapping, q.norm_weight, k.norm_weight, q.eps, k_scale,
                                   v_scale)  # fmt: skip


def defer_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> NormedInput | tuple[NormedInput, torch.Tensor]:
    """What RMSNorm returns when the next layer computes it: as RMSNorm.forward, a NormedInput
    alone, or with a residual (NormedInput, the residual stream the kernel will write)."""
    if residual is None:
        return NormedInput(x, weight, eps)
    residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return NormedInput(x, weight, eps, residual, residual_out), residual_out


def fused_variants(op: nn.Module, next_layer: nn.Module
                   ) -> tuple[type[FusableOp], type[nn.Module]] | None:  # fmt: skip
    """The classes ``op`` and ``next_layer`` take when fused (FUSED_VARIANTS; a module already
    fused keeps its own), or None where the pair cannot be fused."""
    op_class, next_class = (type(m) if type(m) in FUSED_VARIANTS.values()
                            else FUSED_VARIANTS.get(type(m)) for m in (op, next_layer))
    if (op_class is None or next_class is None or not issubclass(op_class, FusableOp)
            or not hasattr(next_class, "fuses")):
        return None
    return op_class, next_class


def fuse(op: nn.Module, next_layer: nn.Module) -> None:
    """Let ``op`` (an RMSNorm, SiluAndMul or RotaryEmbedding) leave its work to ``next_layer``
    whenever ``next_layer.fuses(x)`` says that its fused kernel will run for x: both modules
    become their fused variants, in place (same parameters, buffers and names)."""
    classes = fused_variants(op, next_layer)
    if classes is None:
        raise TypeError(f"{type(op).__name__} cannot be fused into {type(next_layer).__name__}")
    op.__class__, next_layer.__class__ = classes
    # A bound method, not the module: assigning a module would register it a second time.
    setattr(op, "next_layer_fuses", getattr(next_layer, "fuses"))


def fuse_layer_ops(model: nn.Module) -> None:
    """Fuse every pair of FUSED_PAIRS found in ``model`` whose two modules can be fused. Once,
    for a model built on a GPU (worker/model_loading.py): on a CPU no layer would defer."""
    for module in model.modules():
        for op_name, next_name in FUSED_PAIRS:
            try:
                op, next_layer = module.get_submodule(op_name), module.get_submodule(next_name)
            except AttributeError:  # not this module's pair
                continue
            if fused_variants(op, next_layer) is not None:
                fuse(op, next_layer)
