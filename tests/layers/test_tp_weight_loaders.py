"""Tensor-parallel weight loading for world size 2, without processes.

get_tp_rank/get_tp_size are monkeypatched so that a layer built "as rank r" owns rank r's
shard. Loading the full checkpoint tensor into each rank and concatenating the shards along
the split dimension must give back the full tensor; for packed layers, per shard.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from helpers_models import tiny_checkpoint
from helpers_tp_ranks import pretend_rank

from myvllm.layers.embedding_head import ParallelLMHead, VocabParallelEmbedding
from myvllm.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from myvllm.models import get_model_class
from myvllm.utils.checkpoint import iter_checkpoint_tensors
from myvllm.utils.hf_config import load_hf_config
from myvllm.utils.loader import load_model

TP = 2


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(r, size) -> context in which new layers are built as TP rank r of size."""

    def set_rank(rank: int, size: int = TP) -> None:
        pretend_rank(monkeypatch, rank, size)

    return set_rank


def _load(layer: torch.nn.Module, name: str, full: torch.Tensor, shard_id: object = None) -> None:
    param = getattr(layer, name)
    with torch.no_grad():
        if shard_id is None:
            param.weight_loader(param, full)
        else:
            param.weight_loader(param, full, shard_id)


def test_column_parallel(as_rank) -> None:
    w, b = torch.randn(8, 6), torch.randn(8)
    shards = []
    for rank in range(TP):
        as_rank(rank)
        layer = ColumnParallelLinear(6, 8, bias=True)
        assert layer.weight.shape == (4, 6)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        shards.append(layer)
    torch.testing.assert_close(torch.cat([s.weight for s in shards], 0), w, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([s.bias for s in shards], 0), b, atol=0, rtol=0)


def test_row_parallel_and_partial_sums(as_rank, monkeypatch) -> None:
    w, b = torch.randn(5, 8), torch.randn(5)
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda t: None)  # we sum by hand below
    x = torch.randn(3, 8)
    partials = []
    for rank in range(TP):
        as_rank(rank)
        layer = RowParallelLinear(8, 5, bias=True)
        assert layer.weight.shape == (5, 4)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        torch.testing.assert_close(layer.weight, w[:, rank * 4 : (rank + 1) * 4], atol=0, rtol=0)
        torch.testing.assert_close(layer.bias, b, atol=0, rtol=0)  # bias is not split
        partials.append(layer(x[:, rank * 4 : (rank + 1) * 4]))
    # all_reduce of the partial outputs = the full layer (bias added exactly once).
    torch.testing.assert_close(sum(partials), x @ w.T + b, atol=1e-5, rtol=0)


def test_merged_column_parallel(as_rank) -> None:
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    per_rank = []
    for rank in range(TP):
        as_rank(rank)
        layer = MergedColumnParallelLinear(4, [6, 6])
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        per_rank.append(layer.weight.detach())
    # Each rank: [its gate rows | its up rows].
    torch.testing.assert_close(torch.cat([w[:3] for w in per_rank]), gate, atol=0, rtol=0)
    torch.testing.assert_close(torch.cat([w[3:] for w in per_rank]), up, atol=0, rtol=0)


def test_qkv_parallel_whole_heads(as_rank) -> None:
    hidden, head_dim, heads, kv_heads = 5, 3, 4, 2
    q, k, v = (
        torch.randn(heads * head_dim, hidden),
        torch.randn(kv_heads * head_dim, hidden),
        torch.randn(kv_heads * head_dim, hidden),
    )
    qb, kb, vb = (
        torch.randn(heads * head_dim),
        torch.randn(kv_heads * head_dim),
        torch.randn(kv_heads * head_dim),
    )
    parts: dict[str, list[torch.Tensor]] = {"q": [], "k": [], "v": [], "qb": [], "kb": [], "vb": []}
    for rank in range(TP):
        as_rank(rank)
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, bias=True)
        assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
        for shard, full, full_b in (("q", q, qb), ("k", k, kb), ("v", v, vb)):
            _load(layer, "weight", full, shard)
            _load(layer, "bias", full_b, shard)
        qs, ks = 2 * head_dim, head_dim
        w, b = layer.weight.detach(), layer.bias.detach()
        (
            parts["q"].append(w[:qs]),
            parts["k"].append(w[qs : qs + ks]),
            parts["v"].append(w[qs + ks :]),
        )
        (
            parts["qb"].append(b[:qs]),
            parts["kb"].append(b[qs : qs + ks]),
            parts["vb"].append(b[qs + ks :]),
        )
    for key, full in (("q", q), ("k", k), ("v", v), ("qb", qb), ("kb", kb), ("vb", vb)):
        torch.testing.assert_close(torch.cat(parts[key]), full, atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("vocab", [10, 11])  # 11: the last rank holds a zero padding row
def test_vocab_parallel_embedding_and_head(as_rank, monkeypatch, vocab: int) -> None:
    table = torch.randn(vocab, 4)
    monkeypatch.setattr(dist, "all_reduce", lambda t: None)
    ids = torch.arange(vocab)
    rows, outs = [], []
    for rank in range(TP):
        as_rank(rank)
        emb = VocabParallelEmbedding(vocab, 4)
        _load(emb, "weight", table)
        rows.append(emb.weight.detach())
        outs.append(emb(ids))
    full = torch.cat(rows)
    torch.testing.assert_close(full[:vocab], table, atol=0, rtol=0)
    assert torch.count_nonzero(full[vocab:]) == 0
    # Each id is looked up by exactly one rank; the others contribute zeros.
    torch.testing.assert_close(sum(outs), table, atol=0, rtol=0)


def test_lm_head_gathers_on_rank0(as_rank, monkeypatch) -> None:
    table, hidden = torch.randn(11, 4), torch.randn(2, 4)
    shard_logits: dict[int, torch.Tensor] = {}
    heads = {}
    for rank in range(TP):
        as_rank(rank)
        heads[rank] = ParallelLMHead(11, 4)
        _load(heads[rank], "weight", table)
        shard_logits[rank] = hidden @ heads[rank].weight.T

    def fake_gather(tensor, gather_list=None, dst=0):
        # Rank 0's own slice is what it just computed; rank 1's comes from its head.
        if gather_list is not None:
            gather_list[0].copy_(tensor)
            for r in range(1, TP):
                gather_list[r].copy_(shard_logits[r])

    monkeypatch.setattr(dist, "gather", fake_gather)
    torch.testing.assert_close(heads[0](hidden), hidden @ table.T, atol=1e-6, rtol=0)
    assert heads[1](hidden) is None


@pytest.mark.parametrize("size, heads, kv_heads", [(3, 6, 2), (4, 4, 2), (2, 3, 3)])
def test_tp_must_divide_heads(as_rank, size: int, heads: int, kv_heads: int) -> None:
    as_rank(0, size)
    with pytest.raises(
        ValueError,
        match=rf"tensor_parallel_size={size}.*num_attention_heads={heads}.*num_key_value_heads={kv_heads}",
    ):
        QKVParallelLinear(8, 4, heads, kv_heads)


def test_mis_shaped_tensor_names_the_shapes(as_rank) -> None:
    as_rank(1)
    layer = ColumnParallelLinear(6, 8)
    with pytest.raises(ValueError, match=r"\(9, 6\).*size 8"):
        _load(layer, "weight", torch.randn(9, 6))
    with pytest.raises(ValueError, match=r"\(4, 6\).*\(4, 5\)"):
        _load(layer, "weight", torch.randn(8, 5))
    qkv = QKVParallelLinear(6, 2, 4, 2)
    with pytest.raises(ValueError, match="shard_id"):
        _load(qkv, "weight", torch.randn(8, 6), "x")
    rep = ReplicatedLinear(3, 2)
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 3\)"):
        _load(rep, "weight", torch.randn(3, 3))


@pytest.mark.parametrize("kind", ["qwen3_bias", "llama3"])
def test_whole_model_loads_per_rank_and_reassembles(as_rank, kind: str) -> None:
    """load_model on each rank's model; the shards put together are the checkpoint tensors."""
    path = tiny_checkpoint(kind)
    config = load_hf_config(path)
    cls = get_model_class(config.architectures)
    ranks = []
    for rank in range(TP):
        as_rank(rank)
        model = cls(config)
        load_model(model, path)
        ranks.append(dict(model.named_parameters()))
    layers = {name: type(m) for name, m in model.named_modules()}
    q_size = config.num_attention_heads * config.head_dim // TP
    kv_size = config.num_key_value_heads * config.head_dim // TP
    inter = config.intermediate_size // TP
    covered: set[str] = set()  # model parameters some checkpoint tensor was checked against
    for name, full in iter_checkpoint_tensors(path):
        module_name, _, leaf = name.rpartition(".")
        parent, _, proj = module_name.rpartition(".")
        if proj in ("q_proj", "k_proj", "v_proj"):
            start = {"q_proj": 0, "k_proj": q_size, "v_proj": q_size + kv_size}[proj]
            size = q_size if proj == "q_proj" else kv_size
            got = torch.cat([r[f"{parent}.qkv_proj.{leaf}"][start : start + size] for r in ranks])
            covered.add(f"{parent}.qkv_proj.{leaf}")
        elif proj in ("gate_proj", "up_proj"):
            start = 0 if proj == "gate_proj" else inter
            got = torch.cat(
                [r[f"{parent}.gate_up_proj.{leaf}"][start : start + inter] for r in ranks]
            )
            covered.add(f"{parent}.gate_up_proj.{leaf}")
        elif layers.get(module_name) is RowParallelLinear and leaf == "weight":
            got = torch.cat([r[name] for r in ranks], dim=1)
            covered.add(name)
        elif layers.get(module_name) in (
            ColumnParallelLinear,
            VocabParallelEmbedding,
            ParallelLMHead,
        ):
            got = torch.cat([r[name] for r in ranks], dim=0)
            covered.add(name)
        else:  # replicated: norms, row-parallel bias
            for r in ranks:
                torch.testing.assert_close(r[name], full, atol=0, rtol=0, msg=name)
            got = full
            covered.add(name)
        torch.testing.assert_close(got, full, atol=0, rtol=0, msg=name)
    # Every parameter of the model was checked against the checkpoint.
    assert covered == set(ranks[0])
