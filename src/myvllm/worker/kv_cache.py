"""Step 4, start-up: how many KV-cache blocks fit, and the cache tensors themselves: one for
K and one for V, (num_layers, num_blocks, block_size, num_kv_heads_per_rank, head_dim), every
Attention module given a view of its layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from myvllm.config import Config
from myvllm.layers.attention import Attention
from myvllm.utils.distributed import get_tp_size

# A CPU has no "GPU memory" to take a fraction of: its cache is capped at this many bytes.
CPU_KV_CACHE_BYTES = 2 << 30


@dataclass(frozen=True)
class KVCacheLayout:
    """One rank's shape of the cache."""

    num_layers: int
    block_size: int
    num_kv_heads: int  # of this rank
    head_dim: int
    dtype: torch.dtype

    @property
    def block_bytes(self) -> int:
        """Bytes one block takes over all layers, K and V."""
        per_token = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return self.block_size * per_token * self.dtype.itemsize


def count_blocks(config: Config, layout: KVCacheLayout, device: torch.device,
                 max_blocks_per_seq: int, draft_block_bytes: int = 0) -> int:
    """The number of blocks to allocate; under tensor parallelism the minimum over ranks
    (collective: every rank calls it). draft_block_bytes: what a draft model's cache takes
    per block (speculative decoding), allocated beside each block of the target's."""
    block_bytes = layout.block_bytes + draft_block_bytes
    if config.num_kvcache_blocks > 0:
        num_blocks = config.num_kvcache_blocks
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        stats = torch.cuda.memory_stats(device)
        # What the warm-up needed beyond the weights is what every step may need again.
        activation_peak = stats["allocated_bytes.all.peak"] - stats["allocated_bytes.all.current"]
        budget = int(total * config.gpu_memory_utilization) - used - activation_peak
        num_blocks = budget // block_bytes
    else:
        num_blocks = min(config.max_num_sequences * max_blocks_per_seq,
                         CPU_KV_CACHE_BYTES // block_bytes)
    if get_tp_size() > 1:
        # The minimum, or rank 0's block tables would point past another rank's cache.
        count = torch.tensor([num_blocks], dtype=torch.int64, device=device)
        dist.all_reduce(count, op=dist.ReduceOp.MIN)
        num_blocks = int(count.item())
    if num_blocks <= 0:
        raise RuntimeError(
            f"No memory left for the KV cache ({block_bytes} bytes per block of "
            f"{layout.block_size} tokens). Lower max_num_batched_tokens or max_model_length, "
            "or raise gpu_memory_utilization."
        )
    return num_blocks


def allocate_kv_cache(attention_layers: list[Attention], layout: KVCacheLayout,
                      num_blocks: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate K and V caches and give each Attention module its layer's view."""
    shape = (len(attention_layers), num_blocks, layout.block_size, layout.num_kv_heads,
             layout.head_dim)
    k_cache = torch.empty(shape, dtype=layout.dtype, device=device)
    v_cache = torch.empty(shape, dtype=layout.dtype, device=device)
    for layer_id, attention in enumerate(attention_layers):
        attention.k_cache = k_cache[layer_id]
        attention.v_cache = v_cache[layer_id]
    return k_cache, v_cache
