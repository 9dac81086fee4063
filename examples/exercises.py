"""Probes for the exercises of HowToApproachvLLM.md, one or more per step, CPU only.

    uv run python examples/exercises.py paged-slots        # step 1: slots, paged vs dense
    uv run python examples/exercises.py can-append         # step 3: can_append at 24 tokens
    uv run python examples/exercises.py identical-prompts  # step 3: 300 / 512 tokens, size 256
    uv run python examples/exercises.py freed-blocks       # step 3: what freed blocks keep
    uv run python examples/exercises.py block-size         # step 4: block_size 256 vs 16
    uv run python examples/exercises.py preemption         # step 5: who is preempted, where to
    uv run python examples/exercises.py budget             # step 5b: a prompt under a token budget
    uv run python examples/exercises.py step-loop          # step 6: generate() by hand
    uv run python examples/exercises.py speculation        # Features, speculative decoding: propose, verify, accept
    uv run python examples/exercises.py stop-string        # step 7: text held back while streaming
    uv run python examples/exercises.py graph-padding      # fast path: the -1 slot of padding

Each exercise first asks its questions, and you answer: typed in at the prompt in a terminal,
or written into examples/answers.toml (another file with --answers FILE), one [NAME] table per
exercise; with neither, it prints the questions and that table to fill in, and exits 2. Then
the probe drives the real classes (BlockManager, Scheduler, LLMEngine, ModelRunner methods, the
kernels' PyTorch references), prints what happened, and grades each answer against what it
computed: right or wrong, and why. Exit status 0 when all are right, 1 otherwise. --show runs
the probe without asking. tests/docs/test_exercises.py checks that right answers pass and
wrong ones are refused.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))  # run without install
sys.path.insert(0, str(ROOT / "examples"))  # grading, exercise_questions: also when imported

import torch  # noqa: E402

from myvllm.config import Config  # noqa: E402
from myvllm.engine.block_manager import BlockManager  # noqa: E402
from myvllm.engine.batch import StepInputs  # noqa: E402
from myvllm.worker.cuda_graphs import GraphCache  # noqa: E402
from myvllm.worker.input_builder import InputBuilder  # noqa: E402
from myvllm.worker.kv_cache import KVCacheLayout  # noqa: E402
from myvllm.worker.padded_steps import pad_steps  # noqa: E402
from myvllm.engine.scheduler import Scheduler  # noqa: E402
from myvllm.engine.sequence import Sequence  # noqa: E402
from myvllm.kernels import store_kvcache  # noqa: E402
from myvllm.sampling_parameters import SamplingParams  # noqa: E402
from myvllm.worker.pending_tokens import add_pending_token  # noqa: E402

from exercise_questions import QUESTIONS  # noqa: E402
from grading import collect, grade, how_to_answer  # noqa: E402

ANSWERS = ROOT / "examples" / "answers.toml"
Truths = dict[str, object]  # what a probe computed: question key -> the right answer


def input_builder(block_size: int) -> InputBuilder:
    """What the ModelRunner uses to turn a batch into tensors; it needs no model."""
    return InputBuilder(Config(device="cpu", block_size=block_size, max_model_length=64))


def modulo_rule_can_append(bm: BlockManager, seq: Sequence) -> bool:
    """The rule the guide's exercise compares with: a new block is needed iff
    num_tokens % block_size == 1."""
    if seq.num_tokens % bm.block_size == 1:
        return len(bm.free_block_ids) > 0
    return True


# ------------------------------------------------------------------------------------ step 1
def paged_slots() -> Truths:
    from myvllm.kernels.reference import paged_attention_decode_ref

    block_size, table, num_tokens = 4, [7, 2, 9], 10
    slots = [table[p // block_size] * block_size + p % block_size for p in range(num_tokens)]
    print(f"block_size={block_size}, block_table={table}, {num_tokens} tokens")
    print("token  " + " ".join(f"{p:>3}" for p in range(num_tokens)))
    print("slot   " + " ".join(f"{s:>3}" for s in slots))

    torch.manual_seed(0)
    num_heads, num_kv_heads, head_dim = 4, 2, 8
    keys = torch.randn(num_tokens, num_kv_heads, head_dim)
    values = torch.randn(num_tokens, num_kv_heads, head_dim)
    query = torch.randn(1, num_heads, head_dim)
    scale = head_dim ** -0.5

    # Dense attention for one query token over all 10 keys (GQA: head h reads kv head h // 2).
    group = num_heads // num_kv_heads
    k = keys.repeat_interleave(group, dim=1)  # [T, Hq, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,thd->ht", query[0], k) * scale
    dense = torch.einsum("ht,thd->hd", scores.softmax(-1), v)

    def paged(size: int, blocks: list[int]) -> torch.Tensor:
        """Store the keys through store_kvcache into a paged cache, then read them back."""
        num_blocks = max(blocks) + 1
        k_cache = torch.zeros(num_blocks, size, num_kv_heads, head_dim)
        v_cache = torch.zeros_like(k_cache)
        slot_mapping = torch.tensor(
            [blocks[p // size] * size + p % size for p in range(num_tokens)], dtype=torch.int32)
        store_kvcache(keys, values, k_cache, v_cache, slot_mapping)
        out = paged_attention_decode_ref(query, k_cache, v_cache,
                                         torch.tensor([blocks], dtype=torch.int32),
                                         torch.tensor([num_tokens], dtype=torch.int32), scale)
        return out[0]

    same_as_dense = torch.allclose(paged(block_size, table), dense, atol=1e-5)
    other_sizes = {1: list(range(19, 9, -1)), 16: [3]}  # any blocks, in any order
    same_across_sizes = all(torch.allclose(paged(size, blocks), dense, atol=1e-5)
                            for size, blocks in other_sizes.items())
    print(f"paged attention through block_table {table} vs dense: "
          f"{'same' if same_as_dense else 'differs'}; at block sizes 1 and 16: "
          f"{'same' if same_across_sizes else 'differs'}")
    return {"slot_5": slots[5], "slot_9": slots[9], "paged_equals_dense": same_as_dense,
            "any_block_size": same_as_dense and same_across_sizes}


# ------------------------------------------------------------------------------------ 1
def can_append() -> Truths:
    print("BlockManager(num_blocks=3, block_size=8); a 23-token sequence takes all 3 blocks "
          "(8 + 8 + 7 tokens).")
    bm = BlockManager(3, 8)
    seq = Sequence(range(23), 8)
    bm.allocate(seq)
    rows = []
    seq.append_token(23)  # the sampled token is counted before can_append is asked
    rows.append((seq.num_tokens, len(bm.free_block_ids), bm.can_append(seq),
                 modulo_rule_can_append(bm, seq), seq.num_blocks - len(seq.block_table)))
    answer_24 = rows[-1][2]
    bm.append(seq)
    print(f"after append at 24 tokens: block_table={seq.block_table} (unchanged), last block "
          f"hashed={bm.blocks[seq.block_table[-1]].hash != -1} (it just became full)")
    seq.append_token(24)
    rows.append((seq.num_tokens, len(bm.free_block_ids), bm.can_append(seq),
                 modulo_rule_can_append(bm, seq), seq.num_blocks - len(seq.block_table)))
    answer_25 = rows[-1][2]

    print("\nblock_size=1 (our generalization): BlockManager(2, 1), a 2-token sequence")
    bm1 = BlockManager(2, 1)
    one = Sequence([5, 6], 1)
    bm1.allocate(one)
    one.append_token(7)
    rows.append((one.num_tokens, len(bm1.free_block_ids), bm1.can_append(one),
                 modulo_rule_can_append(bm1, one), one.num_blocks - len(one.block_table)))
    print("\nblock_size num_tokens free  new block needed  can_append (ours)  "
          "num_tokens % size == 1 rule")
    for size, (n, free, ours, modulo_rule, needed) in zip((8, 8, 1), rows):
        print(f"{size:>10} {n:>10} {free:>5} {needed:>17} {str(ours):>18}  {modulo_rule}")
    return {"at_24": answer_24, "at_25": answer_25, "modulo_rule_size_1": rows[2][3],
            "ours_size_1": rows[2][2]}


# ------------------------------------------------------------------------------------ 2
def identical_prompts() -> Truths:
    print("Scheduler with block_size=256. Two requests with the SAME prompt; how many prompt "
          "tokens of the second come from the cache, and how many does its prefill compute?")
    print(f"\n{'prompt':>6}  {'arrival':<34} {'cached':>6} {'computed':>8}")
    answers: dict[tuple[int, str], int] = {}
    for length in (300, 512):
        for mode in ("together (one prefill batch)", "after the first finished"):
            config = Config(num_kvcache_blocks=8, block_size=256, max_model_length=1024,
                            max_num_batched_tokens=2048, eos=-1)
            sch = Scheduler(config)
            prompt = [1000 + i for i in range(length)]
            first = Sequence(prompt, 256, SamplingParams(max_tokens=1))
            second = Sequence(prompt, 256, SamplingParams(max_tokens=1))
            sch.add_sequence(first)
            if mode.startswith("together"):
                sch.add_sequence(second)
                batch, _ = sch.schedule()
                assert batch == [first, second]
            else:
                batch, _ = sch.schedule()
                sch.postprocess(batch, [7])
                assert first.is_finished
                sch.add_sequence(second)
                sch.schedule()
            answers[(length, mode.split()[0])] = second.num_cached_tokens
            print(f"{length:>6}  {mode:<34} {second.num_cached_tokens:>6} "
                  f"{length - second.num_cached_tokens:>8}")
    same = all(answers[(n, "together")] == answers[(n, "after")] for n in (300, 512))
    return {"cached_300": answers[(300, "after")], "cached_512": answers[(512, "after")],
            "same_in_both_orders": same}


# ------------------------------------------------------------------------------------ 3
class ClearOnFree(BlockManager):
    """The original's behaviour: a block that is freed forgets its tokens (so it never
    matches again). Ours keeps them; this subclass puts the original's line back."""

    def release_block(self, block_id: int) -> None:
        super().release_block(block_id)
        if self.blocks[block_id].ref_count == 0:
            self.blocks[block_id].token_ids = []


PREFIX = [10, 11, 12, 13, 14, 15, 16, 17]


def _finish(sch: Scheduler, tokens: list[int]) -> Sequence:
    seq = Sequence(tokens, sch.block_size, SamplingParams(max_tokens=1))
    sch.add_sequence(seq)
    batch, _ = sch.schedule()
    sch.postprocess(batch, [99])
    assert seq.is_finished
    return seq


def freed_blocks() -> Truths:
    def scheduler(manager: type[BlockManager]) -> Scheduler:
        sch = Scheduler(Config(num_kvcache_blocks=6, block_size=4, max_model_length=64, eos=-1))
        sch.block_manager = manager(6, 4)
        return sch

    print("(a) X = PREFIX + [1, 2, 3, 4] runs and finishes; then Y = PREFIX + [1, 2, 3, 4, 5] "
          "arrives. block_size=4, 6 blocks.")
    hits = {}
    for manager in (BlockManager, ClearOnFree):
        sch = scheduler(manager)
        _finish(sch, PREFIX + [1, 2, 3, 4])
        y = Sequence(PREFIX + [1, 2, 3, 4, 5], 4, SamplingParams(max_tokens=1))
        sch.add_sequence(y)
        sch.schedule()
        hits[manager.__name__] = y.num_cached_tokens
        label = ("freed blocks keep hash + tokens (ours)" if manager is BlockManager
                 else "freed blocks forget their tokens (original)")
        print(f"    {label:<45} Y: num_cached_tokens = {y.num_cached_tokens}")

    print("\n(b) Eviction. After X finishes, the free list (handed out from the left):")
    sch = scheduler(BlockManager)
    _finish(sch, PREFIX + [1, 2, 3, 4])
    bm = sch.block_manager
    print(f"    X had blocks [0, 1, 2, 3]; free list = {list(bm.free_block_ids)}  (partial "
          "block 3 first, then never-used 4, 5, then X's hashed blocks, its LAST block first)")
    z = _finish(sch, [50 + i for i in range(16)])
    print(f"    Z (16 unrelated tokens) ran and took blocks [3, 4, 5, 2]: block 2 was evicted "
          f"(hash entry deleted, tokens cleared); free list now {list(bm.free_block_ids)}")
    del z
    y = Sequence(PREFIX + [1, 2, 3, 4, 5], 4, SamplingParams(max_tokens=1))
    sch.add_sequence(y)
    sch.schedule()
    evicted_hit = y.num_cached_tokens
    print(f"    Y now: num_cached_tokens = {evicted_hit}, block_table = {y.block_table} (blocks "
          "0 and 1 survived: a prefix's first blocks are freed last, so evicted last)")

    print("\n(c) Who reads the revived blocks? Y's prefill context (InputBuilder.prepare_prefill):")
    step = input_builder(4).prepare_prefill([y])
    for key in ("cu_seqlens_q", "cu_seqlens_k", "block_tables"):
        value = getattr(step.context, key)
        print(f"    {key:<13} {value.tolist() if isinstance(value, torch.Tensor) else value}")
    print("    cu_seqlens_k > cu_seqlens_q and block_tables is set: flash_attention_varlen reads "
          "the cached prefix from the paged cache; positions start at num_cached_tokens")
    paged_prefill = step.context.is_prefill and step.context.block_tables is not None
    return {"hits_kept": hits["BlockManager"], "hits_cleared": hits["ClearOnFree"],
            "stops_matching": "handed-out" if evicted_hit < hits["BlockManager"] else "never",
            "hits_after_eviction": evicted_hit,
            "kernel": "flash_attention_varlen" if paged_prefill else "paged_attention_decode"}


# ------------------------------------------------------------------------------------ 4
HEAD_DIM = 2


class FakeDecodeGraph:
    """Stands in for a CUDA graph captured at batch size `bs`. Like the real one, it runs on
    the static buffers for ALL bs rows, padding rows included. Its 'model' is tiny: the K
    (and V) of a row is its input token id, written to the row's slot by store_kvcache."""

    def __init__(self, step: StepInputs, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.step, self.k_cache, self.v_cache = step, k_cache, v_cache

    def replay(self) -> None:
        ids = self.step.input_ids.float()
        kv = ids[:, None, None].expand(len(ids), 1, HEAD_DIM).contiguous()
        slots = self.step.context.slot_mapping
        assert slots is not None
        store_kvcache(kv, kv, self.k_cache, self.v_cache, slots)


def _store_prompt(seq: Sequence, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """What the prefill would have written: K = V = token id at each prompt token's slot."""
    size = k_cache.shape[1]
    slots = [seq.block_table[p // size] * size + p % size for p in range(len(seq))]
    kv = torch.tensor(seq.token_ids, dtype=torch.float32)[:, None, None]
    kv = kv.expand(len(seq), 1, HEAD_DIM).contiguous()
    store_kvcache(kv, kv, k_cache, v_cache, torch.tensor(slots, dtype=torch.int32))


def _graph_run(padding_slot: str) -> tuple[float, float, list[int], list[int]]:
    """padding_slot: "-1" (as written), "stale" (the original without its fill), or "0"."""
    block_size, max_bs, width = 4, 4, 4
    # Graph sizes 1, 2, 4; block tables 4 wide.
    inputs = InputBuilder(Config(device="cpu", block_size=block_size,
                                 max_num_sequences=max_bs, max_model_length=16))
    # What a GPU does: pad decode steps to a captured graph size, on fixed buffers.
    padded = pad_steps(inputs, chunk_tiles=None)
    assert padded.decode_sizes == [1, 2, 4] and inputs.max_blocks_per_seq == width
    bm = BlockManager(8, block_size)
    k_cache = torch.zeros(8, block_size, 1, HEAD_DIM)
    v_cache = torch.zeros_like(k_cache)
    # What the batch-4 graph reads, filled as capture_decode_inputs leaves it (slots -1).
    static = padded.capture_decode_inputs(max_bs).context
    assert static.slot_mapping is not None
    graphs = GraphCache()
    graphs.graphs = {("decode", bs): FakeDecodeGraph(  # type: ignore[misc]
        padded.decode_inputs(bs), k_cache, v_cache) for bs in (1, 2, 4)}
    graphs.outputs = {("decode", bs): torch.zeros(bs, 1) for bs in (1, 2, 4)}  # their outputs

    def decode(seqs: list[Sequence], token: int) -> list[int]:
        for i, seq in enumerate(seqs):
            seq.append_token(token + i)
            assert bm.can_append(seq)
            bm.append(seq)
        before = static.slot_mapping.clone()  # what the static buffer held from the last step
        step = inputs.prepare_decode(seqs)  # padded to a graph size, padding slots -1
        slots = step.context.slot_mapping
        assert isinstance(slots, torch.Tensor) and slots.data_ptr() == static.slot_mapping.data_ptr()
        pad = slots == -1
        if padding_slot == "stale":
            slots[pad] = before[pad]
        elif padding_slot == "0":
            slots[pad] = 0
        graphs.replay(("decode", step.input_ids.size(0)))  # the real method
        return static.slot_mapping.tolist()

    a, b, c, d = (Sequence([10 * i + 1, 10 * i + 2], block_size) for i in (1, 2, 3, 4))
    for seq in (a, b, c, d):
        bm.allocate(seq)  # blocks 0, 1, 2, 3
        _store_prompt(seq, k_cache, v_cache)
    step1 = decode([a, b, c, d], 101)  # batch 4 -> graph 4, no padding; D writes slot 14
    bm.deallocate(d)  # D finished. Its partial block 3 goes to the FRONT of the free list...
    e = Sequence([501, 502, 503], block_size)
    bm.allocate(e)  # ... so the next request E gets block 3: slots 12, 13, 14
    assert e.block_table == [3]
    _store_prompt(e, k_cache, v_cache)
    step2 = decode([a, b, c], 111)  # batch 3 -> graph 4: row 3 is padding
    return float(k_cache[3, 2, 0, 0]), float(k_cache[0, 0, 0, 0]), step1, step2


def graph_padding() -> Truths:
    print("A, B, C, D (prompts [11, 12], [21, 22], ...) decode with a captured graph of batch "
          "size 4; D finishes and its block 3 goes to a new request E (K = 501, 502, 503 at "
          "slots 12, 13, 14); then A, B, C decode: batch 3 is padded to the batch-4 graph, "
          "row 3 is padding. Runs the real prepare_decode and GraphCache.replay, with fake "
          "graphs whose 'K' is the input token id.\n")
    print(f"{'padding row slot':<38} {'static slot_mapping, step 1 / step 2':<38} "
          f"{'E slot 14':>9} {'A slot 0':>8}")
    results, padded_minus_one = {}, False
    variants = (("-1", "-1 (as written)"), ("stale", "stale (the original, fill deleted)"),
                ("0", "0 (a real slot: block 0, offset 0)"))
    for variant, label in variants:
        e_k, a_k, step1, step2 = _graph_run(variant)
        results[variant] = (e_k, a_k)
        if variant == "-1":
            padded_minus_one = step2[3] == -1  # row 3, the padding row, as prepare_decode wrote it
        print(f"{label:<38} {str(step1) + ' / ' + str(step2):<38} {e_k:>9g} {a_k:>8g}")
    kept_e, kept_a = results["-1"]  # E's K at slot 14 and A's at slot 0 when padding is -1
    return {"stale": "overwritten" if results["stale"][0] != kept_e else "nothing",
            "slot_0_victim": "A" if results["0"][1] != kept_a else "nobody",
            "written_by": "prepare_decode" if padded_minus_one else "replay",
            "honored_by": "store_kvcache" if kept_e == 503 else "replay"}


# ------------------------------------------------------------------------------------ 5
def block_size(kv_gib: float = 1.0, seq_tokens: int = 114, shared_prefix: int = 40) -> Truths:
    from myvllm.utils.hf_config import load_hf_config

    hf_config = load_hf_config(ROOT / "configs" / "Qwen3-0.6B")
    budget = int(kv_gib * (1 << 30))
    print(f"Qwen3-0.6B shapes (configs/Qwen3-0.6B/config.json), bf16, a KV budget of "
          f"{kv_gib:g} GiB. Sequences of {seq_tokens} tokens (a ~50-token chat prompt + 64 "
          "completion tokens, like main.py's).\n")
    print(f"{'block_size':>10} {'bytes/block':>12} {'blocks':>7} {'token slots':>11} "
          f"{'blocks/seq':>10} {'seqs that fit':>13} {'wasted slots/seq':>16} "
          f"{'prefix hit':>10}")
    fits, blocks, memory, hits = {}, {}, {}, {}
    for size in (256, 16):
        layout = KVCacheLayout(num_layers=hf_config.num_hidden_layers, block_size=size,
                               num_kv_heads=hf_config.num_key_value_heads,
                               head_dim=hf_config.head_dim, dtype=torch.bfloat16)
        block_bytes = layout.block_bytes
        num_blocks = budget // block_bytes  # count_blocks: num_blocks = budget // block_bytes
        bm = BlockManager(num_blocks, size, enable_prefix_caching=False)
        count = 0
        while True:
            seq = Sequence([count * seq_tokens + i for i in range(seq_tokens)], size)
            if not bm.can_allocate(seq):
                break
            bm.allocate(seq)
            count += 1
        fits[size], blocks[size], memory[size] = count, num_blocks, num_blocks * block_bytes
        # Prefix caching: a second prompt sharing a `shared_prefix`-token system prompt.
        sch = Scheduler(Config(num_kvcache_blocks=num_blocks, block_size=size,
                               max_model_length=1024, max_num_batched_tokens=4096, eos=-1))
        common = list(range(shared_prefix))
        for tail in ([1, 2, 3], [4, 5, 6]):
            second = Sequence(common + tail, size, SamplingParams(max_tokens=1))
            sch.add_sequence(second)
            sch.postprocess(sch.schedule()[0], [9])
        per_seq, hits[size] = -(-seq_tokens // size), second.num_cached_tokens
        print(f"{size:>10} {block_bytes:>12,} {num_blocks:>7} {num_blocks * size:>11,} "
              f"{per_seq:>10} {count:>13} {per_seq * size - seq_tokens:>16} "
              f"{second.num_cached_tokens:>10}")
    # The same memory up to one block's bytes of rounding: the budget fixes it.
    same_memory = abs(memory[16] - memory[256]) < memory[256] // blocks[256]
    return {"blocks_factor": round(blocks[16] / blocks[256]),
            "memory": "same" if same_memory else "up" if memory[16] > memory[256] else "down",
            "decided_by": "count_blocks",  # the comment in the loop above quotes its line
            "seqs_256": fits[256], "seqs_16": fits[16],
            "cached_256": hits[256], "cached_16": hits[16]}


# ------------------------------------------------------------------------------------ step 5
def preemption() -> Truths:
    config = Config(num_kvcache_blocks=3, block_size=4, max_model_length=64, eos=-1,
                    max_num_sequences=8, max_num_batched_tokens=64)
    sch = Scheduler(config)
    names: dict[int, str] = {}
    for name, start in (("A", 10), ("B", 20), ("C", 30)):
        seq = Sequence(range(start, start + 4), 4, SamplingParams(max_tokens=8))
        names[seq.seq_id] = name
        sch.add_sequence(seq)
    label = lambda seqs: [names[s.seq_id] for s in seqs]  # noqa: E731
    batch, is_prefill = sch.schedule()
    print("Scheduler: 3 KV blocks of 4 tokens; A, B, C arrive with 4-token prompts.")
    print(f"step 1: {'prefill' if is_prefill else 'decode'} {label(batch)}; "
          f"free blocks {len(sch.block_manager.free_block_ids)}")
    sch.postprocess(batch, [1, 1, 1])
    print("each sampled one token: 5 tokens each, so each needs a second block")
    preempted: list[str] = []
    original = sch.preempt

    def record(seq: Sequence) -> None:
        preempted.append(names[seq.seq_id])
        original(seq)

    sch.preempt = record  # type: ignore[method-assign]
    batch, is_prefill = sch.schedule()
    print(f"step 2: {'prefill' if is_prefill else 'decode'} {label(batch)}; preempted in "
          f"order {preempted}; running {label(sch.running)}; waiting {label(sch.waiting)}")
    truths: Truths = {"runs": label(batch), "preempted": preempted,
                      "waiting": label(sch.waiting),
                      "all_tracked": len(sch.running) + len(sch.waiting) == 3}
    sch.postprocess(batch, [2])
    free = len(sch.block_manager.free_block_ids)
    batch, is_prefill = sch.schedule()
    print(f"step 3: {'prefill' if is_prefill else 'decode'} {label(batch)}; free blocks "
          f"before it {free}")
    return truths | {"next_kind": "prefill" if is_prefill else "decode",
                     "next_runs": label(batch)}


# ------------------------------------------------------------------------------------ step 5b
class BudgetStep(NamedTuple):
    line: str  # what the probe prints
    c_tokens: int  # C's prompt tokens computed in this step
    decoding: list[str]  # who decodes in it
    sampled: list[str]


def _budget_run(chunked: bool, budget: int) -> list[BudgetStep]:
    """A and B (3-token prompts) are prefilled and decoding when C (20 tokens) arrives; one
    step each until C has its first token. Tokens are made up: only lengths matter."""
    config = Config(num_kvcache_blocks=32, block_size=4, max_model_length=64, eos=-1,
                    max_num_sequences=8, max_num_batched_tokens=budget,
                    enable_chunked_prefill=chunked)
    sch = Scheduler(config)
    names: dict[int, str] = {}

    def add(name: str, prompt: range) -> Sequence:
        seq = Sequence(prompt, 4, SamplingParams(max_tokens=40))
        names[seq.seq_id] = name
        sch.add_sequence(seq)
        return seq

    add("A", range(10, 13))
    add("B", range(20, 23))
    batch, _ = sch.schedule()
    sch.postprocess(batch, [1] * len(batch))  # both sampled their first token
    c = add("C", range(100, 120))
    steps: list[BudgetStep] = []
    while c.num_completion_tokens == 0:
        batch, is_prefill = sch.schedule()
        rows, c_tokens = [], 0
        for seq in batch:
            start = seq.num_computed_tokens - seq.num_new_tokens if chunked else 0
            end = seq.num_computed_tokens if chunked else len(seq)
            what = f"tokens [{start}, {end})" if seq is c else "decode"
            c_tokens = end - start if seq is c else c_tokens
            rows.append(f"{names[seq.seq_id]} {what}")
        sampled = [s for s in batch if not chunked or s.num_computed_tokens == s.num_tokens]
        kind = ("MIXED" if chunked else "PREFILL") if is_prefill else "DECODE"
        who = [names[s.seq_id] for s in sampled]
        steps.append(BudgetStep(f"step {len(steps) + 1}: {kind:7} {', '.join(rows)}; samples "
                                f"{who}", c_tokens, [r.split()[0] for r in rows if "decode" in r],
                                who))
        sch.postprocess(sampled, [1] * len(sampled))
    return steps


def budget() -> Truths:
    print("A and B are decoding; C arrives with a 20-token prompt. Block size 4.\n")
    print("chunked prefill, max_num_batched_tokens=6:")
    chunked = _budget_run(chunked=True, budget=6)
    print("\n".join("  " + step.line for step in chunked))
    print("\nprefill-first (enable_chunked_prefill=False), max_num_batched_tokens=64:")
    first = _budget_run(chunked=False, budget=64)
    print("\n".join("  " + step.line for step in first))
    sizes = {step.c_tokens for step in chunked}
    return {"chunk_steps": len(chunked), "chunk_tokens": sizes.pop() if len(sizes) == 1 else -1,
            "first_token_step": next(i + 1 for i, step in enumerate(chunked)
                                     if "C" in step.sampled),
            "ab_decode_meanwhile": all(step.decoding == ["A", "B"] for step in chunked),
            "prefill_first_steps": len(first),
            # No probe can show a read of unwritten K/V; the question's why names the test
            # that does.
            "register_all_at_admission": "unwritten"}


# ------------------------------------------------------------------------------------ step 6
def step_loop() -> Truths:
    import importlib.util
    import tempfile

    spec = importlib.util.spec_from_file_location(
        "prefix_cache_demo", ROOT / "examples" / "prefix_cache_demo.py")
    assert spec is not None and spec.loader is not None
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    from myvllm import LLM

    prompts = [[5, 6, 7, 8, 9, 10, 11], [20, 21, 22]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        print("A random 2-layer Qwen3 (examples/prefix_cache_demo.py builds it); prompts of "
              f"{len(prompts[0])} and {len(prompts[1])} tokens, 3 completion tokens each, "
              "greedy.")
        llm = LLM(demo.build_tiny_qwen3(tmp), device="cpu", max_model_length=64,
                  enable_prefix_caching=False)
        seq_ids = [llm.add_request(p, params) for p in prompts]
        by_hand: dict[int, list[int]] = {}
        counts = []
        while not llm.is_finished():
            finished, num_tokens = llm.step()
            counts.append(num_tokens)
            done = [(out["seq_id"], out["token_ids"]) for out in finished]
            print(f"step(): num_tokens={num_tokens:>3}  finished={done}")
            by_hand.update(done)
        reference = llm.generate(prompts, params, use_tqdm=False)
        llm.exit()
    same = [by_hand[i] for i in seq_ids] == [out["token_ids"] for out in reference]
    return {"calls": len(counts), "first_count": counts[0], "decode_count": counts[1],
            "same_as_generate": same}


# ------------------------------------------------------------------------------------ step 7
class _ByteTokenizer:
    """A toy byte-level tokenizer: token id = one byte of UTF-8 (so '€' is three tokens)."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode("utf-8", errors="replace")


def stop_string() -> Truths:
    from myvllm.serving.detokenizer import IncrementalDetokenizer

    text = "5€ Obstacle. Observation: 7"
    stop = "Observation:"
    detok = IncrementalDetokenizer(_ByteTokenizer(), list(b"Q: "), stop=[stop])
    print(f"A completion of {len(text.encode())} byte tokens, {text!r}, stop string {stop!r};")
    print("the delta each token releases to the client:")
    shown, deltas = "", []
    for i, byte in enumerate(text.encode()):
        delta = detok.add_tokens([byte])
        shown += delta
        deltas.append(delta)
        print(f"  token {i:2} {bytes([byte])!r:7} -> {delta!r}")
        if detok.stopped:
            break
    shown += detok.finish()
    euro = text.encode().index("€".encode())  # its three bytes are tokens euro .. euro + 2
    obstacle = text.index("Obstacle") + 2  # + 2: "€" is one character but three tokens
    return {"client_text": shown, "stopped_after": detok.num_tokens if detok.stopped else -1,
            "euro_silent": deltas[euro:euro + 3].count(""),
            "obstacle_silent": deltas[obstacle:obstacle + 8].count("")}


# ------------------------------------------------------------------------------------ speculative decoding
WORDS = ["<pad>", "the", "cat", "sat", "on", "mat", ".", "my", "rug"]


def _words(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


def speculation() -> Truths:
    from myvllm.spec_decode.rejection_sampler import rejection_sample
    from myvllm.spec_decode.verification import accept_greedy

    the, cat, sat, on, mat, dot, my = 1, 2, 3, 4, 5, 6, 7
    prompt = [the, cat, sat, on, the, mat, dot, the, cat]
    config = Config(block_size=4, num_kvcache_blocks=16, max_model_length=64,
                    speculative_method="ngram", num_speculative_tokens=3,
                    prompt_lookup_min=1, prompt_lookup_max=3)
    sch = Scheduler(config)
    seq = Sequence(prompt, 4, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    sch.add_sequence(seq)
    # The prefill step, whose token the "model" says is "sat".
    batch, _ = sch.schedule()
    add_pending_token(seq)  # as EngineCore.step does
    sch.postprocess(batch, [sat])
    print(f"Block size 4, k = 3, prompt lookup 1..3. The sequence so far ({len(seq)} tokens):")
    print(f"  {_words(seq.token_ids)}")
    batch, _ = sch.schedule()
    assert seq.extras is not None  # the speculator made them
    proposals = list(seq.extras.spec_token_ids)
    blocks_verifying = len(seq.block_table)
    print(f"the decode step: proposals {_words(proposals)!r}, {seq.num_new_tokens} new "
          f"tokens, {blocks_verifying} blocks")
    # The target's argmax at the row's k + 1 positions, as if the model preferred "my".
    greedy = [on, my, mat, dot]
    emitted = accept_greedy(proposals, greedy)
    print(f"the target's greedy tokens at the 4 positions: {_words(greedy)!r}; "
          f"emitted: {_words(emitted)!r}")
    add_pending_token(seq)
    sch.postprocess(batch, [0], {0: emitted})
    print(f"after the rollback: {len(seq)} tokens, num_computed_tokens = "
          f"{seq.num_computed_tokens}, {len(seq.block_table)} blocks")
    # Sampling (temperature 1): p(d) = 0.3 for the proposal d at one position, and 20,000
    # rows of that one position through the real rejection sampler.
    p = torch.tensor([0.3, 0.5, 0.2])
    rows = 20_000
    logits = p.log().expand(rows, 2, 3).contiguous()
    drafts = torch.zeros(rows, 1, dtype=torch.int64)  # d = token 0, q = one-hot
    torch.manual_seed(0)
    out = rejection_sample(logits, drafts, [1] * rows, torch.ones(rows))
    accepted = out[:, 1] != -1  # a second token only after an accepted first
    rate = float(accepted.float().mean())
    rejected_first = out[~accepted, 0]
    print(f"sampling, p(d) = 0.3: {rate:.3f} of {rows} rows accepted d; after a rejection "
          f"d itself came out {int((rejected_first == 0).sum())} times")
    # Back-off: three verifications in a row that accept nothing.
    speculator = sch.speculator
    assert speculator is not None
    other = Sequence([the, cat], 4, SamplingParams(temperature=0.0, max_tokens=20))
    state = speculator.state(other)
    for _ in range(3):
        speculator.observe(other, 3, 0)
    return {"proposal": _words(proposals), "accepted": len(emitted) - 1,
            "emitted": _words(emitted), "blocks_verifying": blocks_verifying,
            "computed_after": seq.num_computed_tokens, "blocks_after": len(seq.block_table),
            "accept_rate": min(("0.3", "0.5", "1"), key=lambda o: abs(float(o) - rate)),
            "d_after_rejection": int((rejected_first == 0).sum()),
            "skipped_after_3": state.steps_to_skip}


PROBES = {
    "paged-slots": paged_slots,
    "can-append": can_append,
    "identical-prompts": identical_prompts,
    "freed-blocks": freed_blocks,
    "graph-padding": graph_padding,
    "block-size": block_size,
    "preemption": preemption,
    "budget": budget,
    "step-loop": step_loop,
    "speculation": speculation,
    "stop-string": stop_string,
}


def run_exercise(name: str, answers_file: Path, show: bool) -> int:
    """Ask, probe, grade: 0 all right, 1 something wrong or unanswered, 2 no answers."""
    questions = QUESTIONS[name]
    answers = None
    if not show:
        answers = collect(name, questions, answers_file)
        if answers is None:  # no probe run: its output would give the answers away
            print(how_to_answer(name, questions, answers_file))
            return 2
        print()
    truths = PROBES[name]()
    if answers is None:
        return 0
    verdicts, all_right = grade(questions, answers, truths)
    print("\n" + "\n".join(verdicts))
    print(f"\n{name}: {'all right' if all_right else 'not yet: read the why of each wrong one'}")
    return 0 if all_right else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="exercises: " + ", ".join(PROBES) + " (or 'all')")
    parser.add_argument("exercise", choices=[*PROBES, "all"])
    parser.add_argument("--answers", type=Path, default=ANSWERS,
                        help="TOML file with one [EXERCISE] table of answers (default: %(default)s)")
    parser.add_argument("--show", action="store_true",
                        help="run the probe without asking or grading")
    args = parser.parse_args(argv)
    names = list(PROBES) if args.exercise == "all" else [args.exercise]
    status = 0
    for name in names:
        if len(names) > 1:
            print(f"\n===== {name} =====")
        status = max(status, run_exercise(name, args.answers, args.show))
    return status


if __name__ == "__main__":
    sys.exit(main())
