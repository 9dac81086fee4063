"""The host side of the prefill kernel's fixed-grid launch: which (sequence, query tile,
split) each program computes (see prefill_attention.py), and the decode rows of a padded
chunked step. No Triton here: the engine builds a map every chunked step, and a machine
without Triton imports this module too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TileMap:
    """What each program of a fixed-grid launch computes (see build_tile_map)."""

    rows: torch.Tensor  # [R, 5] int32: sequence, query tile, split, splits, part
    combine: torch.Tensor  # [C, 4] int32: sequence, query tile, splits, first part
    num_parts: int  # partial results the splits may leave


@dataclass
class DecodeRows:
    """The one-token rows of a padded chunked-prefill step, for the decode kernel (a prefill
    tile of 128 query rows would compute 127 for nothing). R = min(max_num_sequences, N)."""

    gather: torch.Tensor  # [R] int64: each row's token in the flat batch (padding: 0)
    scatter: torch.Tensor  # [R] int64: where its output goes (padding: row N, a spare row)
    block_tables: torch.Tensor  # [R, max_blocks] int32
    context_lens: torch.Tensor  # [R] int32: context including the row's token (padding: 0)


# A tile is split only where each split still gets this many key tiles.
SPLIT_KEY_TILES = 16


def build_tile_map(seqlens_q: list[int], seqlens_k: list[int], block_m: int, block_n: int,
                   num_slots: int, num_parts: int,
                   split_key_tiles: int | None = SPLIT_KEY_TILES) -> tuple[list[int], list[int]]:
    """The rows of a TileMap, flattened: (sequence, query tile, split, splits, part) per
    program, heaviest tiles first, padded to num_slots rows with sequence -1; and the
    combine rows (sequence, query tile, splits, first part), padded to num_parts // 2.

    A tile that sees many keys beside few other tiles would keep one program busy while
    the GPU idles (a 448-token chunk after 16k cached tokens: 4 tiles per head). It is cut
    along its keys (split-K): each split gets SPLIT_KEY_TILES key tiles or more and leaves
    a partial result in `part`; the combine rows merge them. Splits go to the heaviest tiles
    while num_parts and the free slots last. split_key_tiles None: no tile is split (the
    batch-invariant mode: how a tile's keys are cut would depend on the rest of the batch).

        seqlens_q = [300, 1], seqlens_k = [1324, 7], block_m = block_n = 128, no splits
        tiles (seq, tile): (0, 2) sees 1324 keys, (0, 1) 1280, (0, 0) 1152, (1, 0) 7
        -> rows [0,2,0,1,-1, 0,1,0,1,-1, 0,0,0,1,-1, 1,0,0,1,-1] + padding
    """
    tiles = []  # (keys seen, sequence, tile, unmasked key tiles)
    for seq, (seqlen_q, seqlen_k) in enumerate(zip(seqlens_q, seqlens_k, strict=True)):
        ctx_offset = seqlen_k - seqlen_q
        for tile in range(-(-seqlen_q // block_m)):
            m0 = tile * block_m
            full_end = (ctx_offset + m0 + 1) // block_n * block_n  # as the kernel's
            tiles.append((ctx_offset + min(m0 + block_m, seqlen_q), seq, tile,
                          full_end // block_n))
    if len(tiles) > num_slots:
        raise ValueError(f"build_tile_map: {len(tiles)} query tiles, only {num_slots} slots")
    tiles.sort(key=lambda t: -t[0])  # the most keys first (a stable sort keeps ties in order)
    rows: list[int] = []
    combine: list[int] = []
    free, parts = num_slots - len(tiles), 0
    for _, seq, tile, full_tiles in tiles:
        if split_key_tiles is None:
            rows += [seq, tile, 0, 1, -1]
            continue
        splits = min(full_tiles // split_key_tiles, free + 1, num_parts - parts)
        if splits < 2:
            rows += [seq, tile, 0, 1, -1]
            continue
        combine += [seq, tile, splits, parts]
        for split in range(splits):
            rows += [seq, tile, split, splits, parts + split]
        free -= splits - 1
        parts += splits
    rows += [-1, 0, 0, 1, -1] * (num_slots - len(rows) // 5)
    combine += [-1, 0, 0, 0] * (num_parts // 2 - len(combine) // 4)
    return rows, combine


def tile_map_slots(num_tokens: int, max_num_seqs: int, block_m: int, num_parts: int) -> int:
    """Enough TileMap rows for any batch of num_tokens new tokens in at most max_num_seqs
    sequences: each sequence adds at most one partial tile to num_tokens / block_m full ones,
    and splits add at most num_parts rows."""
    return -(-num_tokens // block_m) + min(max_num_seqs, num_tokens) + num_parts
