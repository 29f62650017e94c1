"""Sparse embedding gradients (TriRace): what exchanging only the touched rows costs.

An input embedding's gradient is zero outside the rows of the token ids a replica's batch
used, so replicas may exchange those rows (an all-gather of each member's rows and ids,
padded to the largest count, then summed locally) instead of all-reducing the whole
``vocab x hidden`` matrix (:attr:`potluck.plans.CommSchedule.sparse_embedding_grads`;
``potluck.runtime.grads`` does it). That pays when the rows touched are few against the
vocabulary: an all-gather of ``d`` members' ``u`` rows moves ``(d - 1) u`` rows per link
against the ring all-reduce's ``2 (d - 1) / d V``, so while ``u < 2 V / d``.

How many distinct ids ``n`` tokens of text hold is modelled by Zipf's law: the ``r``-th
most frequent token has probability proportional to ``1 / r^a`` (Zipf 1949; it holds for
subword vocabularies too, with an exponent near one: Gallé, EMNLP 2019, "Investigating the
effectiveness of BPE"), and the expected number of distinct ids among ``n`` independent
draws is ``sum_r 1 - (1 - p_r)^n``. A tied embedding is never sparse: the output layer's
gradient touches every row.
"""

from __future__ import annotations

import math
from functools import cache

import numpy as np

ZIPF_EXPONENT = 1.0  # token frequency ~ 1 / rank^a (Zipf 1949; Gallé 2019 for BPE tokens)
INDEX_BYTES = 8  # each row travels with its int64 id


@cache
def expected_unique_tokens(tokens: int, vocab_size: int, exponent: float = ZIPF_EXPONENT
                           ) -> float:
    """Expected distinct token ids among ``tokens`` Zipf-distributed tokens of a vocabulary
    of ``vocab_size``."""
    if tokens <= 0 or vocab_size <= 0:
        return 0.0
    ranks = np.arange(1, vocab_size + 1, dtype=np.float64)
    weights = ranks ** -exponent
    p = weights / weights.sum()
    return float(np.sum(-np.expm1(tokens * np.log1p(-p))))


def sparse_exchange_bytes(rows: float, hidden_size: int, element_bytes: int, members: int
                          ) -> float:
    """The all-gather's result size: every member's ``rows`` touched rows (padded to the
    largest) with their ids."""
    return members * math.ceil(rows) * (hidden_size * element_bytes + INDEX_BYTES)
