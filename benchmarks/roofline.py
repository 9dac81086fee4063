"""The roofline of a run: the least time each step could take, from what it must move and
compute, beside the time it took (benchmark_tps.py --timeline).

A step reads every weight once (the matmuls stream them whatever the batch), reads the
K/V of every token its sequences attend to, writes the K/V of its new tokens, and does the
FLOPs of its new tokens (2 per weight per token, plus attention). Its least time is
whichever of the two takes longer:

    ideal = max(bytes / copy bandwidth, FLOPs / matmul throughput)

Both ceilings are measured on the machine at the start (a large device-to-device copy, a
large bf16 matmul), not taken from a data sheet. Per rank under tensor parallelism: the
weights and K/V heads are those of rank 0.

Mixture-of-experts layers count every expert's weights as read (at the bench workload's
batch every expert is hit in every layer) and top_k / num_experts of their FLOPs per token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    """What the roofline needs to know of one rank's model."""

    weight_bytes: int  # read once per step (the input embedding's table excluded)
    matmul_params_per_token: float  # weights one token multiplies by (MoE: the active ones)
    kv_bytes_per_token: int  # K and V over all layers
    attention_flops_per_pair: int  # FLOPs of one (query, key) pair over all layers and heads
    lm_head_params: int  # its weights (of this rank); only sampled rows multiply by them

    @classmethod
    def from_engine(cls, llm: Any) -> ModelShape:
        runner = llm.model_runner
        model, layout, hf = runner.model, runner.kv_layout, runner.hf_config
        top_k = getattr(hf, "num_experts_per_tok", None)
        num_experts = getattr(hf, "num_experts", None)
        expert_share = top_k / num_experts if top_k and num_experts else 1.0
        embed_weight = model.model.embed_tokens.weight
        lm_head_weight = model.lm_head.weight  # the same Parameter when tied
        weight_bytes, matmul_params, lm_head_params = 0, 0.0, 0
        for name, param in model.named_parameters():  # a tied Parameter is listed once
            is_lm_head = param is lm_head_weight
            if param is embed_weight and not is_lm_head:
                continue  # the embedding looks up a few rows, it is not streamed
            weight_bytes += param.numel() * param.element_size()
            if is_lm_head:
                lm_head_params = param.numel()
            elif param.dim() >= 2:
                matmul_params += param.numel() * (expert_share if "experts" in name else 1.0)
        num_heads = hf.num_attention_heads // max(1, runner.config.tensor_parallel_size)
        # q.k and p.v: 2 FLOPs per multiply-add, head_dim of each, per head and layer.
        pair_flops = 4 * layout.head_dim * num_heads * layout.num_layers
        per_token = 2 * layout.num_layers * layout.num_kv_heads * layout.head_dim
        return cls(weight_bytes, matmul_params, per_token * layout.dtype.itemsize, pair_flops,
                   lm_head_params)


@dataclass(frozen=True)
class StepWork:
    bytes_read: int
    bytes_written: int
    flops: float

    def ideal_ms(self, copy_gb_s: float, matmul_tflop_s: float) -> float:
        memory = (self.bytes_read + self.bytes_written) / (copy_gb_s * 1e9)
        compute = self.flops / (matmul_tflop_s * 1e12)
        return max(memory, compute) * 1e3


def step_work(shape: ModelShape, rows: list[tuple[int, int]], sampled_rows: int) -> StepWork:
    """rows: (new tokens, context after the step) of each sequence in the step; a decode row
    is (1, its length). Each sequence's K/V is read once (a floor: the prefill kernel reads
    it once per query tile)."""
    new_tokens = sum(new for new, _ in rows)
    context = sum(ctx for _, ctx in rows)
    # Causal pairs: each new token sees the context before the chunk and the chunk up to it.
    pairs = sum(new * (ctx - new) + new * (new + 1) // 2 for new, ctx in rows)
    flops = (2 * shape.matmul_params_per_token * new_tokens
             + 2 * shape.lm_head_params * sampled_rows
             + shape.attention_flops_per_pair * pairs)
    return StepWork(shape.weight_bytes + context * shape.kv_bytes_per_token,
                    new_tokens * shape.kv_bytes_per_token, flops)


def measure_ceilings(device: str) -> tuple[float, float]:
    """(copy bandwidth GB/s: bytes read + written, bf16 matmul TFLOP/s) on this device."""
    cuda = device == "cuda"
    n = (1 << 28) if cuda else (1 << 22)  # 512 MiB of bf16 on a GPU, 8 MiB on a CPU
    src = torch.empty(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    size = 8192 if cuda else 256
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)

    def best_s(fn: Any, repeats: int = 10) -> float:
        fn()
        times = []
        for _ in range(repeats):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return min(times)

    copy_s = best_s(lambda: dst.copy_(src))
    matmul_s = best_s(lambda: a @ b)
    return 2 * n * 2 / copy_s / 1e9, 2 * size**3 / matmul_s / 1e12


def summarize(steps: list[dict[str, Any]], buckets: list[tuple[str, Any]],
              output_tokens: int, copy_gb_s: float, matmul_tflop_s: float) -> str:
    """Measured against ideal time, by kind of step, and over the whole run."""
    lines = [f"roofline: copy {copy_gb_s:,.0f} GB/s, bf16 matmul {matmul_tflop_s:.3g} TFLOP/s "
             "(measured here); ideal = max(bytes / copy, FLOPs / matmul) per step",
             f"{'steps':>22} {'count':>6} {'measured s':>11} {'ideal s':>8} {'ideal/meas':>10} "
             f"{'GB read':>8} {'TFLOP':>7}"]
    for name, select in buckets:
        chosen = [s for s in steps if select(s)]
        if not chosen:
            continue
        measured = sum(s["total_ms"] for s in chosen) / 1e3
        ideal = sum(s["ideal_ms"] for s in chosen) / 1e3
        lines.append(f"{name:>22} {len(chosen):>6} {measured:>11.3f} {ideal:>8.3f} "
                     f"{ideal / measured:>10.0%} "
                     f"{sum(s['bytes_read'] for s in chosen) / 1e9:>8.1f} "
                     f"{sum(s['flops'] for s in chosen) / 1e12:>7.2f}")
    measured = sum(s["total_ms"] for s in steps) / 1e3
    ideal = sum(s["ideal_ms"] for s in steps) / 1e3
    lines.append(f"whole run: {measured:.2f} s measured, {ideal:.2f} s ideal ({ideal / measured:.0%}"
                 f"); at the ideal, {output_tokens / ideal:,.0f} output tok/s "
                 f"(measured in this step-by-step run: {output_tokens / measured:,.0f})")
    return "\n".join(lines)
