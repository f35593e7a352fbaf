"""Learn a deployment's prefill speed from its engine's step cadence, where no hook times a request.

The controller's ``T_recompute`` is its profile's prediction times a learned ratio (``LatencyModel.prefill_ratio``):
measured seconds over predicted. The reference engine and the simulator time each request's prefill; an engine's
connector usually cannot (vLLM 0.33 hands a ``KVConnectorBase_V1`` no compute time). What the scheduler side does
see is the step: ``build_connector_meta(scheduler_output)`` when a step is scheduled, with every request's chunk in
it, and ``update_connector_output`` when that step's output is back — one call per executed step, in order (vLLM's
batch queue is first in, first out). So a step's forward pass lasted::

    step_s = t_out(k) − max(t_scheduled(k), t_out(k − 1))

(the max: with async scheduling step k is scheduled while step k − 1 still runs, and starts when it ends; an idle
engine schedules nothing, so idle time is never inside a step). Two things keep the pairing right: the engine holds
at most ``steps_in_flight`` steps (vLLM's ``max_concurrent_batches``), so when one is scheduled the older ones are
done; and an empty step (nothing to run, scheduled to collect finished transfers) is reported only when its output
carries something, so an output that carries nothing belongs to the first step that ran — and one that carries
something is the empty step's only if it came back sooner than half the fixed part of a step that ran (an empty
step runs nothing). Until that fixed part is learned such an output is taken for the empty step's.

A step's time is a fixed part — reading the weights, the decode tokens' attention — plus the prefill chunks it
computes::

    step_s ≈ base_s + ratio × Σ_chunks T_prefill(before, before + computed)

``base_s`` is the intercept of a Theil–Sen line of ``step_s`` on ``Σ T_prefill`` through the ``recent_steps`` newest
steps (a step with no prefill chunk at 0; a chunk of fewer than ``prefill_min_tokens`` tokens is a decode step's,
speculative tokens included) — the median of the pairwise slopes, robust to stalls, and learned from the prefill steps
themselves, as an engine under load seldom runs a step without one. While the predictions do not spread enough to
tell slope from intercept, the median decode-only step stands in; the prefill steps wait for either (after
``4 × min_samples`` of them without, the fixed part is taken as 0 — counted as compute). Every step whose chunks the
profile predicts to take at least ``base_s`` gives one sample ``(step_s − base_s) / Σ T_prefill`` of the ratio.
Steps that carry a synchronous load (its transfer runs inside the forward pass) are left out. With pipeline
parallelism several steps run at once, one per stage, and the gap between outputs is a stage's time, not a step's:
do not use a timer there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

import numpy as np

from .._validate import check_positive_int
from ..errors import ConfigError
from .model import LatencyModel


class StepTimer:
    """Pairs an engine's scheduled steps with their outputs and feeds the model what they show of its compute."""

    def __init__(self, model: LatencyModel, now_s: Callable[[], float], *, prefill_min_tokens: int = 16, steps_in_flight: int = 1,
                 recent_steps: int = 128) -> None:
        if not isinstance(model, LatencyModel):
            raise ConfigError("model", f"must be a kvpolicy LatencyModel, got {type(model).__name__}")
        if not callable(now_s):
            raise ConfigError("now_s", f"must be a callable returning the scheduler's time in seconds, got {now_s!r}")
        for name, v in (("prefill_min_tokens", prefill_min_tokens), ("steps_in_flight", steps_in_flight), ("recent_steps", recent_steps)):
            check_positive_int(name, v)
        self.model = model
        self.now_s = now_s
        self.prefill_min_tokens = prefill_min_tokens
        #: how many steps the engine keeps scheduled at once (vLLM's ``max_concurrent_batches``: 1, or 2 with async
        #: scheduling); when a step is scheduled, every step older than the ``steps_in_flight − 1`` before it is done
        self.steps_in_flight = steps_in_flight
        #: decode-only steps' seconds (the fixed part of a step), windowed as the model's own terms
        self.base = model._make()
        # steps scheduled and not yet out: (scheduled at s, predicted prefill s or None for a decode-only step, left out,
        # empty: nothing scheduled — its output is reported only when it carries something)
        self._in_flight: deque[tuple[float, float | None, bool, bool]] = deque()
        self._last_out_s: float | None = None
        self._waiting: list[tuple[float, float]] = []  # prefill steps (predicted s, measured s) until the fixed part is known
        #: (predicted prefill s, measured s) of the newest timed steps: the line whose intercept is a step's fixed part
        self._recent: deque[tuple[float, float]] = deque(maxlen=recent_steps)
        self._fit: tuple[int, float | None] | None = None  # (timed steps when fitted, the fixed part then)
        self.steps = {"timed": 0, "prefill_samples": 0, "decode_samples": 0, "left_out": 0, "unpaired": 0}

    def scheduled(self, chunks: Iterable[tuple[int, int]], *, left_out: bool = False) -> None:
        """A step was scheduled with these ``(tokens_before, tokens_computed)`` chunks, one per request in it (none: an
        empty step, run to collect finished transfers). ``left_out``: time it (the next step starts after it) but
        learn nothing from it (a synchronous load inside its forward pass)."""
        pred, any_prefill, n = 0.0, False, 0
        for before, computed in chunks:
            n += 1
            if computed >= self.prefill_min_tokens:
                any_prefill = True
                pred += self.model.prefill_seconds(before, before + computed)
        # the engine holds at most steps_in_flight steps, this one included: the older ones are done — an empty step's
        # output is not reported when it carries nothing, and a step whose output never came is one a caller did not report
        while len(self._in_flight) > self.steps_in_flight - 1:
            if not self._in_flight.popleft()[3]:
                self.steps["unpaired"] += 1
        self._in_flight.append((self.now_s(), pred if any_prefill else None, left_out, n == 0))

    def finished(self, *, carries: bool = True) -> float | None:
        """The oldest scheduled step's output is back: returns its seconds (None when no step was waiting).
        ``carries``: the output carries something (finished or failed transfers, stats, events) — an empty step's
        output is reported only then, so an output that carries nothing is a step's that ran (vLLM's
        ``KVConnectorOutput.is_empty()``)."""
        now = self.now_s()
        while self._in_flight and self._in_flight[0][3]:  # an empty step first in line: is this its output?
            if carries and len(self._in_flight) > 1:
                # or the next step's, the empty one's not reported: an empty step runs nothing, so its output is back
                # right after the engine is free, sooner than half the fixed part of a step that ran
                t_sched = self._in_flight[0][0]
                since = now - (t_sched if self._last_out_s is None else max(t_sched, self._last_out_s))
                fixed_s = self.fixed_s if self.fixed_s is not None else (
                    self.base.quantile(0.5) if self.base.count >= self.model.min_samples else None)
                if fixed_s is None or since < 0.5 * fixed_s:
                    break
            elif carries:
                break
            self._in_flight.popleft()  # an empty step whose output was not reported
        if not self._in_flight:
            return None
        t_sched, pred, left_out, empty = self._in_flight.popleft()
        start = t_sched if self._last_out_s is None else max(t_sched, self._last_out_s)
        self._last_out_s = now
        step_s = max(now - start, 0.0)
        if empty:
            return step_s
        self.steps["timed"] += 1
        if left_out or step_s <= 0.0:
            self.steps["left_out"] += 1
            return step_s
        self._recent.append((0.0 if pred is None else pred, step_s))
        if pred is None:
            self.base.record(step_s)
            self.steps["decode_samples"] += 1
        else:
            self._waiting.append((pred, step_s))
        if self._waiting:
            if self._fit is None or self.steps["timed"] - self._fit[0] >= 16:  # refitted every 16 steps: ~0.3 ms a fit
                self._fit = (self.steps["timed"], self.fixed_part_s())
            base_s = self._fit[1]
            if base_s is not None:
                self._flush(base_s)
            elif len(self._waiting) >= 4 * self.model.min_samples:
                self._flush(0.0)  # nothing to learn the fixed part from yet: counted as compute (recompute looks slower)
        return step_s

    @property
    def fixed_s(self) -> float | None:
        """The fixed part of a step as last fitted (refitted every 16 steps while prefill steps come); None before."""
        return self._fit[1] if self._fit is not None else None

    def fixed_part_s(self) -> float | None:
        """The fixed part of a step: the intercept of a Theil–Sen line of step time on predicted prefill through
        the recent steps (decode-only ones at 0) — robust to stalls, and learned from the prefill steps themselves
        where an engine under load seldom runs a decode-only step — when their predictions spread enough to tell
        slope from intercept; else the median decode-only step once there are ``min_samples``; else None."""
        if len(self._recent) >= self.model.min_samples:
            x, y = np.array(self._recent).T
            dx = x[None, :] - x[:, None]
            keep = np.triu(np.abs(dx) > 0.25 * (x.max() - x.min()), 1) & (x.max() > 0)
            if np.count_nonzero(keep) >= self.model.min_samples:
                slope = float(np.median((y[None, :] - y[:, None])[keep] / dx[keep]))
                return max(float(np.median(y - slope * x)), 0.0)
        if self.base.count >= self.model.min_samples:
            return self.base.quantile(0.5) or 0.0
        return None

    def _flush(self, base_s: float) -> None:
        """Feed the prefill steps waiting for the fixed part of a step to the model."""
        for pred, step_s in self._waiting:
            if pred > 0 and pred >= base_s and step_s > base_s:
                self.model.observe_prefill_batch(pred, step_s - base_s)
                self.steps["prefill_samples"] += 1
            else:  # the fixed part dominates: too noisy a sample of the compute
                self.steps["left_out"] += 1
        self._waiting.clear()
