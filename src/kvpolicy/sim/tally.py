"""The run's figures (issue #61's rooms): what every room counts, in one place that decides nothing.

A room that moves bytes or spends GPU time adds to the :class:`Tally` it was handed; nothing reads a figure back to
make a decision. The held-out split lives here too: a figure counts only requests from ``judge_k`` on (bytes moved
from their arrival time ``t_judge`` on): each room compares a request's index with ``judge_k``, a time with ``t_judge``.
"""

from __future__ import annotations

import numpy as np


class Tally:
    """Counters and per-request arrays of one run (``judge_k`` = 0: every request is judged)."""

    __slots__ = ("judge_k", "t_judge", "gpu_prefill_s", "bytes_read", "bytes_written", "bytes_sent", "bytes_pulled", "bytes_direct",
                 "bytes_unused", "loads", "loads_ok", "loads_failed", "loads_timeout", "retries", "stall_s", "warmup_bytes",
                 "warm_loads", "warm_loads_ok", "warm_loads_failed", "warm_loads_timeout", "ttft", "queue", "prefill_per",
                 "completed", "routes", "t_last")

    def __init__(self, n_requests: int, judge_k: int, t_judge: float) -> None:
        self.judge_k = judge_k
        #: the judged split's first arrival (−inf: every request is judged)
        self.t_judge = t_judge
        self.gpu_prefill_s = 0.0
        self.bytes_read = self.bytes_written = self.bytes_sent = self.bytes_pulled = self.bytes_direct = 0
        #: bytes that crossed the network and were not used (whole-run: not split)
        self.bytes_unused = 0
        self.loads = self.loads_ok = self.loads_failed = self.loads_timeout = self.retries = 0
        self.stall_s = 0.0
        self.warmup_bytes = 0
        self.warm_loads = self.warm_loads_ok = self.warm_loads_failed = self.warm_loads_timeout = 0
        n = n_requests
        self.ttft = np.full(n, np.nan)
        self.queue = np.full(n, np.nan)  # seconds each request waited for a prefill slot (its last attempt)
        self.prefill_per = np.zeros(n)  # GPU seconds of prefill each request took (every attempt)
        self.completed = np.zeros(n, dtype=np.int64)
        self.routes = np.full(n, -1, dtype=np.int64)
        self.t_last = 0.0
