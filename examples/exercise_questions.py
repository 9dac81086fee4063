"""The questions of each exercise probe (examples/exercises.py), with the reason behind each
answer. The answers themselves are not here: the probes compute them from the real classes."""

from __future__ import annotations

from grading import Question

PAD_FUNCTIONS = ("prepare_decode", "store_kvcache", "replay")

QUESTIONS: dict[str, list[Question]] = {
    "paged-slots": [
        Question("slot_5", "A sequence owns blocks [7, 2, 9] at block size 4: which slot does "
                 "token 5 use?", "number",
                 "slot = block_table[p // block_size] * block_size + p % block_size: token 5 is "
                 "offset 1 of logical block 1, physical block 2."),
        Question("slot_9", "Which slot does token 9 use?", "number",
                 "Token 9 is offset 1 of logical block 2, physical block 9."),
        Question("paged_equals_dense", "Ten keys stored through those slots: does decode "
                 "attention through the block table give exactly dense attention over them?",
                 "yes/no", "The table only says where each position is stored; attention "
                 "gathers the same keys in the same order."),
        Question("any_block_size", "And with the same keys stored at block size 1 (ten blocks, "
                 "in reverse order) or 16 (one block)?", "yes/no",
                 "Attention never sees blocks, only the positions the table maps: the block "
                 "size is a memory-management choice (exercise 4)."),
    ],
    "can-append": [
        Question("at_24", "Block size 8, 24 tokens (the just-sampled one included), no free "
                 "block: does can_append return true?", "yes/no",
                 "Token 24 takes the last slot of the third block; append() only hashes that "
                 "block, which has just become full."),
        Question("at_25", "And at 25 tokens?", "yes/no",
                 "Token 25 is the first of a fourth block and none is free; the scheduler then "
                 "preempts the tail of running, it never drops the sequence."),
        Question("modulo_rule_size_1", "At block size 1 with no free block, does the rule "
                 "`num_tokens % block_size == 1` let the sequence append?", "yes/no",
                 "x % 1 is never 1, so the rule never asks for a block, although at block size "
                 "1 every token needs one."),
        Question("ours_size_1", "And does our can_append?", "yes/no",
                 "Ours compares the block table's length with num_blocks, which is right at "
                 "every block size."),
    ],
    "identical-prompts": [
        Question("cached_300", "Block size 256: two requests with the same 300-token prompt. "
                 "How many prompt tokens of the second come from the cache?", "number",
                 "One full block; the 44-token tail is a partial block, never hashed."),
        Question("cached_512", "And with the same 512-token prompt?", "number",
                 "Both blocks match, but a prefill must compute at least the last token, so "
                 "the last block is recomputed, in a fresh block."),
        Question("same_in_both_orders", "Is that the same whether both requests are alive "
                 "together or the second arrives after the first finished?", "yes/no",
                 "Freed blocks keep their hash and tokens here. In the article's code the "
                 "answer depended on the order: freed blocks forgot their tokens."),
    ],
    "freed-blocks": [
        Question("hits_kept", "(a) A pool of 6 blocks of 4 tokens. X = PREFIX + [1, 2, 3, 4] "
                 "(PREFIX is 8 tokens) runs and finishes; then Y = PREFIX + [1, 2, 3, 4, 5] "
                 "arrives. How many of Y's tokens hit the cache?", "number",
                 "X's three full blocks are freed but keep their hashes and tokens, so Y "
                 "revives all three."),
        Question("hits_cleared", "And if freed blocks forgot their tokens, as in the article's "
                 "code?", "number",
                 "Nothing matches a block that forgot its tokens. The tests that guard reuse "
                 "across requests then fail, among them "
                 "tests/core/test_block_manager.py::test_prefix_cache_survives_the_sequence_that_filled_it, "
                 "tests/core/test_scheduler.py::test_prefix_served_from_cache_after_first_request_finished "
                 "and "
                 "tests/engine/test_engine.py::test_prefix_reuse_across_generate_calls_matches_cold_engine."),
        Question("stops_matching", "(b) When does a freed block stop matching?", "choice",
                 "_allocate_fresh_block deletes its hash entry and reset() clears its tokens: "
                 "that is eviction.", ("freed", "handed-out", "never")),
        Question("hits_after_eviction", "In the same pool of 6 blocks: after X finished, Z "
                 "(16 unrelated tokens, 4 blocks) runs and finishes. How many of Y's tokens hit "
                 "now?", "number",
                 "The free list hands out unhashed blocks first, then hashed ones, least "
                 "recently freed first; deallocate frees a block table last block first, so Z "
                 "evicted X's third block and the prefix's two blocks survived."),
        Question("kernel", "(c) Which kernel reads a revived block in Y's prefill?", "choice",
                 "Y's prefill context has cu_seqlens_k > cu_seqlens_q and block_tables set: "
                 "flash_attention_varlen runs in paged mode and reads the cached prefix, and "
                 "the positions start at num_cached_tokens.",
                 ("flash_attention_varlen", "paged_attention_decode", "store_kvcache")),
    ],
    "block-size": [
        Question("blocks_factor", "Qwen3-0.6B's shapes, a bf16 KV cache (2 bytes an "
                 "element), a 1 GiB budget: block size 256 -> 16 multiplies the number of "
                 "blocks by how much?", "number",
                 "A block's bytes are proportional to block_size, and the budget is fixed."),
        Question("memory", "And the KV cache's memory?", "choice",
                 "The memory budget, not the block size, fixes it; the token capacity stays "
                 "the same up to rounding.", ("up", "down", "same")),
        Question("decided_by", "Which function decides the number of blocks?", "choice",
                 "kv_cache.count_blocks: num_blocks = budget // block_bytes, with "
                 "block_bytes = KVCacheLayout.block_bytes = block_size * 2 * layers * kv_heads * head_dim * "
                 "dtype size.", ("count_blocks", "allocate_kv_cache", "BlockManager")),
        Question("seqs_256", "How many sequences of 114 tokens fit in that bf16 GiB at block "
                 "size 256?", "number",
                 "Each sequence takes a whole block of 256 slots for its 114 tokens: 142 of "
                 "them stay empty."),
        Question("seqs_16", "And at block size 16?", "number",
                 "8 blocks of 16 per sequence (128 slots for 114 tokens): a sequence wastes "
                 "at most block_size - 1 slots in its last block, so about twice as many fit."),
        Question("cached_256", "Two prompts share a 40-token prefix: how many tokens of the "
                 "second come from the cache at block size 256?", "number",
                 "Only full blocks are shared, and 40 tokens fill no block of 256."),
        Question("cached_16", "And at block size 16?", "number",
                 "Two full blocks of 16; the last 8 tokens of the prefix sit in a partial one."),
    ],
    "preemption": [
        Question("runs", "3 blocks of 4 tokens; A, B, C (4-token prompts) were prefilled and "
                 "each sampled one token, so each needs a second block. Who runs in the next "
                 "decode step?", "names",
                 "For A, can_append fails, so the tail of running, C, is preempted, and its "
                 "block is enough for A."),
        Question("preempted", "Who is preempted, in which order?", "names",
                 "The tail of running first; then, for B, can_append fails and nobody is left "
                 "behind it, so B preempts itself."),
        Question("waiting", "What does waiting hold afterwards, front first?", "names",
                 "Each victim goes to the front of waiting, so the order of admission is kept."),
        Question("all_tracked", "Are all three sequences still tracked (none dropped)?",
                 "yes/no", "Preemption frees blocks; it never drops a sequence."),
        Question("next_kind", "Is the step after that a prefill or a decode?", "choice",
                 "B, at the head of waiting, needs 2 blocks for its 5 tokens and only 1 is "
                 "free, and C may not jump ahead of it.", ("prefill", "decode")),
        Question("next_runs", "Who runs in it?", "names",
                 "A decodes again; B is recomputed (prompt + completion) once A frees blocks."),
    ],
    "budget": [
        Question("chunk_steps", "A and B are decoding; C arrives with a 20-token prompt; "
                 "max_num_batched_tokens=6. How many steps does C's prompt take?", "number",
                 "Decode rows go first, one token each, and prompt chunks fill what is left."),
        Question("chunk_tokens", "How many of C's tokens does each of those steps compute?",
                 "number", "6 tokens of budget minus the 2 decode rows."),
        Question("first_token_step", "In which of those steps does C sample its first token?",
                 "number", "The one whose chunk reaches C's last prompt token; before it, C's "
                 "row is not sampled."),
        Question("ab_decode_meanwhile", "Do A and B decode in every one of those steps?",
                 "yes/no", "Rule 1 of the token budget: decode rows first."),
        Question("prefill_first_steps", "How many steps does prefill-first (a budget of 64) "
                 "take for C's prompt?", "number",
                 "One, in which A and B skip their decode: an earlier first token for C, a "
                 "gap in A's and B's streams."),
        Question("register_all_at_admission", "What would go wrong if admission registered "
                 "all of C's prompt blocks in the prefix cache at once?", "choice",
                 "A request admitted meanwhile with the same prompt would hit C's last blocks "
                 "and read K/V nobody wrote yet; _schedule_chunk registers a block only in the "
                 "step that writes it (tests/engine/test_chunked_prefill.py::"
                 "test_blocks_of_a_prompt_still_in_prefill_are_shared_only_once_written).",
                 ("nothing", "unwritten", "refused")),
    ],
    "step-loop": [
        Question("calls", "Two prompts of 7 and 3 tokens, 3 greedy completion tokens each, "
                 "driven with add_request and step(): how many step() calls?", "number",
                 "One prefill, which yields each sequence's first token, then two decode "
                 "steps."),
        Question("first_count", "What token count does the first call return?", "number",
                 "A step with prompt tokens counts the tokens it computed: 7 + 3."),
        Question("decode_count", "And each decode step?", "number",
                 "A pure decode step counts minus one per sequence: that sign is how "
                 "generate() tells the two apart."),
        Question("same_as_generate", "Do you get generate()'s tokens?", "yes/no",
                 "generate() is that loop plus bookkeeping."),
    ],
    "speculation": [
        Question("proposal", "Tokens 'the cat sat on the mat . the cat sat', k = 3, prompt "
                 "lookup 1..3: which tokens does the n-gram proposer propose?", "text",
                 "The suffix 'the cat sat' (n = 3, the longest) first occurred at the start; "
                 "the 3 tokens after it there are 'on the mat'."),
        Question("accepted", "The target's greedy tokens at the row's 4 positions are 'on my "
                 "mat .': how many proposals are accepted?", "number",
                 "'on' equals the argmax at position 1; 'the' is not 'my', and nothing after "
                 "the first rejection counts."),
        Question("emitted", "Which tokens does the row emit?", "text",
                 "The accepted proposals, then the target's own token at the first mismatch: "
                 "what decoding one at a time would have given."),
        Question("blocks_verifying", "Block size 4: how many blocks does the sequence hold "
                 "while the step verifies?", "number",
                 "10 tokens and 3 proposals need K/V at 13 positions: 4 blocks "
                 "(append(seq, num_lookahead=3))."),
        Question("computed_after", "After the step, what is num_computed_tokens?", "number",
                 "12 tokens now; the K/V of positions 0..10 came from accepted inputs, the "
                 "newest token's is written by the next step."),
        Question("blocks_after", "And how many blocks does it hold?", "number",
                 "12 tokens fit in 3 blocks: the fourth held only rejected proposals and is "
                 "released (free_lookahead_blocks)."),
        Question("accept_rate", "Sampling at temperature 1, the target gives the proposal d "
                 "probability 0.3 at its position: how often is d accepted?", "choice",
                 "q is one-hot at d, so d is accepted with probability min(1, p(d) / 1) = "
                 "p(d).", ("0.3", "0.5", "1")),
        Question("d_after_rejection", "In 20,000 such rows, how many times does d come out "
                 "after a rejection?", "number",
                 "The residual max(0, p - q) is 0 at d (0.3 - 1 < 0): d comes out with "
                 "probability 0.3 in all, exactly p(d)."),
        Question("skipped_after_3", "Three verifications in a row accept nothing: how many "
                 "of the sequence's next decode steps skip the lookup?", "number",
                 "Each miss doubles the back-off: 2, 4, then 8 steps (at most 64); a "
                 "verification that accepts at least half resets it."),
    ],
    "stop-string": [
        Question("euro_silent", "A byte-level tokenizer streams '5€ Obstacle. Observation: 7' "
                 "with the stop string 'Observation:'. How many of the three tokens of '€' "
                 "release no text?", "number",
                 "Until its third byte the text would end in half a character ('\\ufffd')."),
        Question("obstacle_silent", "How many tokens of 'Obstacle' release no text?", "number",
                 "'O', 'Ob', 'Obs' may each begin the stop string; the 't' shows they do not "
                 "and releases 'Obst' at once."),
        Question("client_text", "What text does the client receive in all, exactly (every "
                 "space counts: it is what the stream held back or released)?", "exact text",
                 "The output ends right before the stop string: the space in front of it was "
                 "released as it came (no stop string begins with a space), and from the stop "
                 "string's 'O' on nothing is released."),
        Question("stopped_after", "After how many of the 29 tokens does the request stop?",
                 "number", "The ':' completes the stop string; AsyncLLM then aborts the engine "
                 "request, freeing its blocks, and reports finish_reason 'stop'."),
    ],
    "graph-padding": [
        Question("stale", "D finished and its block went to E. If the padding row of the next "
                 "step (batch 3 padded to 4) kept D's stale slot instead of -1, what would "
                 "happen to E's K/V?", "choice",
                 "A padding row runs through the whole graph like a real one and writes K/V "
                 "at its slot: a finished sequence corrupts the one that got its block, "
                 "silently.", ("nothing", "overwritten", "error")),
        Question("slot_0_victim", "And with slot 0, whose K/V is overwritten?", "choice",
                 "Any real slot belongs to someone: slot 0 is the first token of block 0, A's.",
                 ("nobody", "A", "E")),
        Question("written_by", "Which function writes our -1 into a decode step's padding "
                 "rows?", "choice",
                 "InputBuilder.prepare_decode pads the batch (through PaddedSteps.decode: "
                 "slot -1, context length 0), and the graphs are captured on slots of -1.",
                 PAD_FUNCTIONS),
        Question("honored_by", "Which one skips a slot of -1?", "choice",
                 "store_kvcache: kernels/store_kvcache_kernel.py masks slot >= 0, "
                 "kernels/reference.py keeps slot_mapping >= 0.", PAD_FUNCTIONS),
    ],
}
