"""The experts of a mixture-of-experts (MoE) layer, tensor-parallel, and its router's top-k.

A MoE layer replaces the one MLP of a decoder layer by E experts (each a gated MLP) and a
router (models/qwen3_moe.py). The router scores every expert for every token; each token goes
through its k best, and their outputs are summed, weighted by the router's probabilities:

    probs        = softmax(router_logits)                  # [M, E], float32
    w, ids       = topk(probs, k)                          # [M, k]; w /= w.sum() if renormalize
    out[t]       = sum_j w[t, j] * expert_{ids[t, j]}(x[t])

All experts' weights are stacked so that one kernel serves them all (fused_moe,
kernels/fused_ops.py):

    w13_weight [E, 2*I, H]   expert e's gate_proj rows, then its up_proj rows
    w2_weight  [E, H, I]     expert e's down_proj

Tensor parallelism splits every expert the way the dense MLP is split: each rank holds a
1/tp slice of every expert's intermediate dimension, gate and up sliced separately (as
MergedColumnParallelLinear does), down_proj along its input. Each rank routes every token
(the router is replicated), runs its slices of the chosen experts, and one all-reduce sums
the partial outputs:

    rank r:  w13[e] = [gate_e[r*I/tp : (r+1)*I/tp] ; up_e[same rows]]   [2*I/tp, H]
             w2[e]  = down_e[:, r*I/tp : (r+1)*I/tp]                     [H, I/tp]

Checkpoints store each expert's matrices under its own names; the loader (utils/loader.py,
through the model's expert_params_mapping) hands each to weight_loader with the shard id
(expert, "w1" | "w3" | "w2"), vLLM's names for gate_proj, up_proj and down_proj:

    model.layers.3.mlp.experts.17.up_proj.weight -> model.layers.3.mlp.experts.w13_weight,
                                                    shard (17, "w3")
"""

from __future__ import annotations

import torch
from torch import nn

from myvllm.kernels.fused_ops import fused_moe
from myvllm.layers.weight_loaders import copy_checked, divide, rank_slice, set_weight_attrs
from myvllm.utils.distributed import all_reduce, get_tp_rank, get_tp_size

# Checkpoint name of an expert's matrix -> (our parameter, shard id).
EXPERT_PARAMS_MAPPING: dict[str, tuple[str, str]] = {
    "gate_proj": ("w13_weight", "w1"),
    "up_proj": ("w13_weight", "w3"),
    "down_proj": ("w2_weight", "w2"),
}


def select_experts(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [M, E] -> (weights [M, k] float32, expert ids [M, k]), as transformers'
    Qwen3-MoE router: softmax over all experts in float32, the k largest, divided by their
    sum when renormalize (config.norm_topk_prob). The weights stay in float32 (as in vLLM);
    transformers rounds them to the model dtype before it multiplies."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class FusedMoE(nn.Module):
    """E experts of intermediate size I over hidden size H; forward(x, router_logits)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool) -> None:  # fmt: skip
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.intermediate_size = intermediate_size  # the full size; this rank holds 1/tp
        inter = divide(intermediate_size, self.tp_size, "moe_intermediate_size")
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, inter))
        for param in (self.w13_weight, self.w2_weight):
            set_weight_attrs(param, {"weight_loader": self.weight_loader})

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None
    ) -> None:
        """Copy this rank's slice of one expert's full gate/up/down_proj into the stack."""
        ok = (isinstance(shard_id, tuple) and len(shard_id) == 2
              and isinstance(shard_id[0], int) and 0 <= shard_id[0] < self.num_experts
              and shard_id[1] in ("w1", "w2", "w3"))  # fmt: skip
        if not ok:
            raise ValueError(f"FusedMoE needs shard id (expert in 0..{self.num_experts - 1}, "
                             f"'w1' | 'w2' | 'w3'), got {shard_id!r}")  # fmt: skip
        assert isinstance(shard_id, tuple)
        expert, name = shard_id
        what = f"FusedMoE expert {expert} {name}"
        full, tp = self.intermediate_size, self.tp_size
        if name == "w2":  # down_proj [H, I]: this rank's columns
            src = rank_slice(loaded_weight, 1, full, self.tp_rank, tp, what)
            copy_checked(param.data[expert], src, what)
            return
        src = rank_slice(loaded_weight, 0, full, self.tp_rank, tp, what)
        offset = 0 if name == "w1" else full // tp  # gate rows first, then up rows
        copy_checked(param.data[expert].narrow(0, offset, full // tp), src, what)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [M, H], router_logits [M, E] -> [M, H], summed over the ranks."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_moe(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        if self.tp_size > 1:
            all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, "
                f"w13={tuple(self.w13_weight.shape)}, w2={tuple(self.w2_weight.shape)}, "
                f"tp={self.tp_rank}/{self.tp_size}")  # fmt: skip
