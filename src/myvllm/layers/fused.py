"""The op before a matmul, fused into it where the matmul is a skinny_gemm.

A decode step at batch 1 is bound by kernel launches, not by math: on an H200 each of its
~310 kernels costs ~3 us, most of them far more than their work. Three per decoder layer
only touch one row each and feed a matmul that reads all of that row anyway, so the matmul
(kernels.skinny_gemm, used for a few rows on a GPU) applies them to x as it loads it:

    norm_linear:          input_layernorm          -> qkv_proj        one kernel, not two
                          post_attention_layernorm -> gate_up_proj
    silu_and_mul_linear:  act_fn (SiLU and mul)    -> down_proj

Everywhere else (prefill, larger batches, a CPU, a layer with a bias) both functions run the
two layers one after the other, so they always compute what the unfused layers compute.

The module that owns the matmul calls them (models/decoder.py): the attention runs the
decoder layer's input_layernorm with its qkv_proj, the MLP post_attention_layernorm with its
gate_up_proj and its act_fn with its down_proj.
"""

from __future__ import annotations

import torch

from myvllm.kernels import rms_norm_skinny_gemm, silu_and_mul_skinny_gemm
from myvllm.layers.activation import SiluAndMul
from myvllm.layers.layernorm import RMSNorm
from myvllm.layers.linear import ColumnParallelLinear, RowParallelLinear, uses_skinny_gemm


def norm_linear(norm: RMSNorm, layer: ColumnParallelLinear, x: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (layer(norm(x + residual)), x + residual), the new residual stream.

    residual None (the first layer): the residual stream starts as x itself.
    A column-parallel layer needs no collective, so the fused kernel is the whole layer.
    """
    if uses_skinny_gemm(x, layer.weight, layer.bias):
        if residual is None:
            return rms_norm_skinny_gemm(x, norm.weight, norm.eps, layer.weight), x
        out, residual = rms_norm_skinny_gemm(x, norm.weight, norm.eps, layer.weight, residual)
        return out, residual
    if residual is None:
        return layer(norm(x)), x
    x, residual = norm(x, residual)
    return layer(x), residual


def silu_and_mul_linear(act_fn: SiluAndMul, layer: RowParallelLinear,
                        gate_up: torch.Tensor) -> torch.Tensor:
    """layer(act_fn(gate_up)) for gate_up = [gate | up] (the output of gate_up_proj).

    A row-parallel layer sums its ranks' partial outputs (layer.reduce) after the kernel.
    """
    if uses_skinny_gemm(gate_up, layer.weight, layer.bias):
        return layer.reduce(silu_and_mul_skinny_gemm(gate_up, layer.weight))
    return layer(act_fn(gate_up))
