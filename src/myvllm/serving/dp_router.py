"""Which data-parallel replica a request goes to: by its prompt's prefix, else the least loaded.

    router = PrefixRouter(num_replicas=2, block_size=16)
    r = router.route(prompt_token_ids)      # a replica index, 0..num_replicas-1
    router.started(r, n)                    # n sequences (SamplingParams.n) now in flight there
    router.finished(r, n)                   # ... and done

Every replica has a prefix cache of its own: a prompt whose first blocks were computed on
replica r finds them only there. So the rule keys by what the cache keys by: each full block
of block_size tokens together with everything before it (the cache chains its block hashes for
the same reason; here one running hash of the tokens up to each block's end), and remembers
which replica last took a prompt with that prefix:

1. A prompt shorter than one block has no full block, so nothing a cache could share: it goes
   to the least-loaded replica.
2. Otherwise its first blocks (up to MAX_ROUTED_BLOCKS) are hashed, and the longest prefix the
   router has seen picks the replica that last took it, unless that replica is overloaded
   (below), or no prefix was seen: then the least-loaded replica.
3. Every block hash of the prompt is then recorded for the replica chosen, in a bounded LRU
   map (MAX_TRACKED_BLOCKS), so later prompts sharing any leading part follow it.

Load is the number of sequences in flight on a replica, counted here as requests start and
finish: it is exact at the moment of the decision, even for a burst of requests arriving in
the same instant, where the cores' reported queues would lag behind.

Overload: one prefix that every request shares (a system prompt) would otherwise send all of
them to one replica and leave the others idle. A prompt follows its prefix only while that
replica's load is within max(BALANCE_ABS, BALANCE_REL * least) of the least-loaded replica's;
past it the request goes to the least loaded, which computes the prefix once and from then on
takes its share (the map names the last replica). A few sequences more on one replica cost
little (a decode step's time grows slowly with its batch), a replica left idle costs its whole
throughput. SGLang's cache-aware router balances the same way (an absolute and a relative
threshold); vLLM's data-parallel front end balances by queue length alone.

The baselines the prefix rule is measured against: "least_loaded" (step 2 without the prefix:
also the rule when prefix caching is off), and "round_robin", which ignores prompts and loads:
replica 0, 1, ..., 0, 1, ...
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import xxhash

from myvllm.value_checks import is_int, one_of, refusal

ROUTING_POLICIES = ("prefix", "least_loaded", "round_robin")

# Blocks of a prompt hashed for routing: 64 blocks of 16 tokens are 1,024 tokens, enough to
# tell apart the prompts that share a system prompt or a conversation, and the front end's
# cost per request stays bounded however long the prompt (0.25 ms to hash 64 blocks, measured
# on a busy 2-core CPU).
MAX_ROUTED_BLOCKS = 64
# Block hashes remembered (the LRU map): about 4,000 requests' worth of 64 blocks, a few tens
# of MB; a prefix not seen for that long has likely left the replica's cache too.
MAX_TRACKED_BLOCKS = 1 << 18
BALANCE_ABS = 8  # sequences: below this difference in load, a prefix always wins
BALANCE_REL = 0.25  # or this fraction of the least-loaded replica's load, when larger


class PrefixRouter:
    def __init__(self, num_replicas: int, block_size: int, policy: str = "prefix",
                 max_tracked_blocks: int = MAX_TRACKED_BLOCKS,
                 balance_abs: int = BALANCE_ABS, balance_rel: float = BALANCE_REL) -> None:
        if not (is_int(num_replicas) and num_replicas >= 1):
            raise refusal("PrefixRouter.num_replicas", num_replicas, "an int >= 1")
        if not (is_int(block_size) and block_size >= 1):
            raise refusal("PrefixRouter.block_size", block_size, "an int >= 1")
        if policy not in ROUTING_POLICIES:
            raise refusal("data-parallel routing", policy, one_of(ROUTING_POLICIES))
        if not (is_int(max_tracked_blocks) and max_tracked_blocks >= 1):
            raise refusal("PrefixRouter.max_tracked_blocks", max_tracked_blocks, "an int >= 1")
        self.num_replicas = num_replicas
        self.block_size = block_size
        self.policy = policy
        self.max_tracked_blocks = max_tracked_blocks
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.load = [0] * num_replicas  # sequences in flight, per replica
        self.num_routed = [0] * num_replicas  # requests sent, per replica (for stats, tests)
        self._replica_of_block: OrderedDict[int, int] = OrderedDict()  # block hash -> replica
        self._next = 0  # round_robin's turn

    def route(self, token_ids: Sequence[int]) -> int:
        """The replica for a prompt (and, under "prefix", its blocks recorded for it)."""
        if self.policy == "round_robin":
            replica = self._next
            self._next = (self._next + 1) % self.num_replicas
        elif self.policy == "least_loaded":
            replica = self.least_loaded()
        else:
            hashes = self.block_hashes(token_ids)
            replica = self._choose(hashes)
            self._remember(hashes, replica)
        self.num_routed[replica] += 1
        return replica

    def started(self, replica: int, num_sequences: int = 1) -> None:
        self.load[replica] += num_sequences

    def finished(self, replica: int, num_sequences: int = 1) -> None:
        self.load[replica] -= num_sequences
        assert self.load[replica] >= 0, "a replica finished more sequences than it started"

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """One hash per leading full block of the prompt (at most MAX_ROUTED_BLOCKS), of all
        the tokens up to that block's end: two prompts share hash i exactly when they share
        blocks 0..i, as the prefix cache's chained block hashes do (one running xxhash here,
        cheaper than the cache's hash per block; the router needs no cache's values)."""
        size = self.block_size
        end = min(len(token_ids) // size, MAX_ROUTED_BLOCKS) * size
        data = memoryview(np.asarray(token_ids[:end], dtype="<i8").tobytes())
        step = size * 8  # bytes per block
        running = xxhash.xxh64()
        hashes: list[int] = []
        for start in range(0, end * 8, step):
            running.update(data[start:start + step])
            hashes.append(running.intdigest())  # of every token up to this block's end
        return hashes

    def least_loaded(self) -> int:
        """The replica with the fewest sequences in flight (the lowest index among equals)."""
        return min(range(self.num_replicas), key=self.load.__getitem__)

    def _choose(self, hashes: list[int]) -> int:
        least = self.least_loaded()
        for h in reversed(hashes):  # the longest prefix seen wins
            replica = self._replica_of_block.get(h)
            if replica is not None:
                slack = max(self.balance_abs, self.balance_rel * self.load[least])
                return replica if self.load[replica] <= self.load[least] + slack else least
        return least

    def _remember(self, hashes: list[int], replica: int) -> None:
        table = self._replica_of_block
        for h in hashes:
            table[h] = replica
            table.move_to_end(h)
        while len(table) > self.max_tracked_blocks:
            table.popitem(last=False)  # the least recently routed prefix
