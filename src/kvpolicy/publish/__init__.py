"""Publish filters: put in the shared pool only what another request will re-read.

Publishing every finished block is the most harmful setting: user tails are
mostly unique, so the pool pays for writes, indexing and eviction with no
re-read. A filter answers one question per finished (or prefilled) request —
how many **leading** full blocks may be published (0 = none) — so the published
set stays prefix-closed, and learns from ``observe`` (called once per request,
before ``publishable``; repeated calls for the same request id are ignored).

Policies (compose with :class:`AllOf` — the minimum — and :class:`WriteBudget`):

* ``never`` — a read-only pool (the brief's first experiment);
* ``all`` — the baseline;
* ``threshold-k`` — a block after k **distinct requests** containing it (the
  SGLang / vLLM / KVBM style) — counted per request, never per lookup;
* ``boundary`` — only blocks wholly before the application's mark
  (``PublishRequest.boundary_tokens``: system prompt, template, knowledge-base
  version, de-identified document) and nothing of a ``private`` data class, ever;
* ``reuse-aware`` — kvpolicy's: publish a block when its expected value exceeds
  its write cost (below).

**reuse-aware.** Evidence is the number of distinct requests that contained the
block, decayed with half-life ``half_life_s``, kept in a Count-Min sketch
(``width`` × ``depth`` counters: memory is fixed at 8 × width × depth bytes; a
count is overestimated by at most ε·N with probability 1 − δ, ε = e/width,
δ = e^−depth, N the decayed total of sightings — with the defaults 2^18 × 4
(8 MiB), ε ≈ 1.0e-5 · N at δ ≈ 1.8 %, under half a request while N < 48k).
With ĉ the decayed count including this request::

    rate       = (ĉ − 1) / half_life_s                      (other requests per second)
    P(reuse)   = 1 − exp(−rate × lifetime_s)                if the block was seen before
               = P(a new block is seen again | bucket)      on its first sighting
    value      = P(reuse) × cross_replica_share × recompute_s(depth)
    cost       = t_write × ρ/(1 − ρ) + index_s + eviction_s,   t_write = block_bytes / write_bytes_per_s

ρ is the recent utilisation of the write's path (``PublishRequest.write_path_utilisation``,
measured by the engine): a write on a shared link costs the delay it imposes
on the traffic it shares the link with — t_write × ρ/(1 − ρ), the M/M/1 delay
a job of length t_write adds to a queue at load ρ (capped at ρ = 0.99). When ρ
is unknown the cost is the full t_write (a busy-link assumption: conservative).
    publish the leading run n maximising Σ_{j<n} (value_j − cost)

Publishing is prefix-closed (a block is useless remotely without its prefix), so
a deep block worth publishing carries the shallow blocks it needs even when each
of those alone would not pay; the run stops where everything after it is worth
less, in total, than it costs.

The first-sighting probability is **learned**, per bucket of how much of the
request was itself reused (quarters of its blocks: a mid-session request reuses
most of its prompt): of the new blocks such requests created, the share that was
seen again within ``lifetime_s`` (Laplace-smoothed). A block is counted only
once its ``lifetime_s`` window has closed — until then "not seen again yet" is
not evidence of "never" (counting it early biases every trace's start towards
p ≈ 0); before any window has closed the estimate is the prior, ½. It lets a live session's newest turn be published
before the next turn needs it, and keeps unique tails out. Origins are tracked for
the newest ``origin_capacity`` new blocks (memory bound).

**WriteBudget** is a token bucket on written bytes per second (``burst_bytes``
deep); when it runs low it sheds the lowest-value blocks first: a block is
admitted only while tokens last and its value is at least
``value_floor × (1 − fill)`` (fill = tokens / burst).

The filters live in :mod:`.rules` (never, all, threshold-k, boundary, AllOf), :mod:`.value` (reuse-aware,
structure-aware, WriteBudget) and :mod:`.dueling`; :mod:`.specs` builds them from a spec.
"""

from .dueling import DuelingPublish, gpu_price
from .rules import (DATA_CLASSES, AllOf, BoundaryPublish, NeverPublish, PublishAll, PublishFilter, PublishRequest, ThresholdPublish,
                    _Dedup)
from .specs import check_spec, make_filter
from .value import CountMinSketch, ReuseAwarePublish, StructureAwarePublish, WriteBudget, best_prefix

__all__ = ["DATA_CLASSES", "AllOf", "BoundaryPublish", "CountMinSketch", "DuelingPublish", "NeverPublish", "PublishAll", "PublishFilter",
           "PublishRequest", "ReuseAwarePublish", "StructureAwarePublish", "ThresholdPublish", "WriteBudget", "best_prefix", "check_spec",
           "make_filter", "gpu_price", "_Dedup"]
