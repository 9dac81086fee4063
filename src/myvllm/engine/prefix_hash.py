"""The prefix cache's hash of a full block, chained over every block before it.

The same tokens after two different pasts have different K/V, so a block's hash covers its
prefix's too (the guide's Step 3, "Why hashes are chained").
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf

import numpy as np
import xxhash


def compute_hash(token_ids: SequenceOf[int], prefix: int = -1) -> int:
    """xxhash64 over the previous block's hash (if any), then the tokens as int64."""
    h = xxhash.xxh64()
    if prefix != -1:
        h.update(prefix.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.intdigest()  # unsigned 64-bit: never -1
