"""Sweeps: a grid of independent jobs — scenario × policy set, policy × capacity — run here, on local processes, or on
a Ray cluster, with the same results in the same order wherever they ran.

A job is ``fn(shared, spec)``: ``shared`` is what every job reads (the trace, the cluster), sent once to each worker
process (or put once in Ray's object store), and ``spec`` is the job's own small description. ``fn`` must be a
module-level function (workers import it by name) and deterministic in its arguments — every simulator and replay in
kvpolicy takes its seed from ``spec`` — so a parallel run returns exactly what a sequential one does
(``tests/test_sweep.py`` checks the reports byte for byte).

* ``Sweep(jobs=1)``: in this process, one job after another (no pickling, no start-up).
* ``Sweep(jobs=N)``: ``N`` local worker processes (``spawn``: a fresh interpreter each, nothing inherited but
  ``shared``). Default in the CLI: the machine's cores (``os.cpu_count()``).
* ``Sweep(ray_address=...)``: Ray — ``"auto"`` (the cluster this machine belongs to), ``"ray://host:10001"`` (a
  remote one), or ``"local"`` (start one here for this sweep, ``jobs`` CPUs). Needs ``pip install 'kvpolicy[ray]'``.

Expected scaling: the wall time is about max(longest job, Σ job times / workers) + start-up (≈ 1–2 s per spawned
worker: it imports kvpolicy and numpy; Ray adds its own start). ``benchmarks/bench_sweep.py`` measures it.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from typing import Any

import attrs

from ._validate import check_positive_int
from .errors import ConfigError, KVPolicyError

#: memory set aside per worker process when capping ``jobs`` (a spawned worker imports numpy and numba and holds the
#: shared trace: ~150-300 MB on the built-in data); 51 workers of an evict-bench grid took 8.1 GB on 2 cores
WORKER_MEMORY_BYTES = 512 * 2**20


class SweepWorkerDied(KVPolicyError):
    """A worker process ended without answering (killed — the OOM killer's SIGKILL —, or ``os._exit`` in a job)."""

#: what a spawned worker keeps between jobs: ``shared``, set once by the pool's initializer. It lives only in worker
#: processes (never in the parent), and only for the pool's life.
_WORKER_SHARED: list[Any] = []


def _init_worker(shared: Any) -> None:
    _WORKER_SHARED[:] = [shared]


def _run_in_worker(fn: Callable[[Any, Any], Any], spec: Any) -> Any:
    return fn(_WORKER_SHARED[0], spec)


def _run_on_ray(fn: Callable[[Any, Any], Any], shared: Any, spec: Any) -> Any:
    return fn(shared, spec)


#: HTTP/2's client connection preface and an empty SETTINGS frame: what a gRPC client (Ray's) sends first
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A ``HOST:PORT`` or ``ray://HOST:PORT`` address must accept a TCP connection and answer as Ray's gRPC servers do
    — an HTTP/2 SETTINGS frame for a client's preface, within ``timeout_s`` (``auto`` is Ray's to resolve). A port that
    accepted TCP but spoke something else passed the TCP check and then held ``ray.init`` for 550 s and more."""
    if address == "auto":
        return
    hostport = address[len("ray://"):] if address.startswith("ray://") else address
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError("--ray", f"must be 'auto', 'local', HOST:PORT or ray://HOST:PORT, got {address!r}")
    try:
        conn = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s)
    except OSError as e:
        raise ConfigError("--ray", f"nothing answers at {address!r} ({e.strerror or e}): start the cluster (ray start --head) or pass "
                                   "--ray local") from None
    got = b""
    try:
        with conn:
            conn.settimeout(timeout_s)
            conn.sendall(_H2_PREFACE)
            while len(got) < 9:
                part = conn.recv(9 - len(got))
                if not part:
                    break
                got += part
    except OSError:
        pass
    if len(got) < 9 or got[3] != 0x04:  # a frame header whose type is SETTINGS
        raise ConfigError("--ray", f"something answers at {address!r}, but not a Ray cluster (no gRPC answer within {timeout_s:g} s): "
                                   "check the address and port (the head's GCS port, 6379 by default, or ray://HOST:10001)")


def memory_available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_jobs() -> int:
    """The cores this process may use (its CPU affinity where the OS reports one)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except AttributeError:  # pragma: no cover - not Linux
        return max(os.cpu_count() or 1, 1)


@attrs.frozen
class Sweep:
    #: worker processes (1: run in this process)
    jobs: int = 1
    #: a Ray cluster's address ("auto", "ray://host:port"), or "local" to start one here; None: no Ray
    ray_address: str | None = None

    def __attrs_post_init__(self) -> None:
        try:
            check_positive_int("--jobs", self.jobs)
        except ConfigError:
            raise ConfigError("--jobs", f"must be a positive int (worker processes), got {self.jobs!r}") from None
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise ConfigError("--ray", f"must be a Ray address ('auto', 'ray://host:port') or 'local', got {self.ray_address!r}")

    def workers(self, n_specs: int | None = None) -> int:
        """The local processes this sweep starts: ``jobs``, capped by the cores this process may use, by the memory
        available (WORKER_MEMORY_BYTES a worker) and by the jobs there are — never more workers than the machine holds."""
        cap = min(self.jobs, default_jobs())
        avail = memory_available_bytes()
        if avail is not None:
            cap = min(cap, max(avail // WORKER_MEMORY_BYTES, 1))
        return max(min(cap, n_specs if n_specs is not None else cap), 1)

    @property
    def where(self) -> str:
        if self.ray_address is not None:
            return f"Ray ({self.ray_address})"
        n = self.workers()
        capped = f" (--jobs {self.jobs} capped by this machine's cores and memory)" if n < self.jobs else ""
        return ("this process" if n == 1 else f"{n} local processes") + capped

    def map(self, fn: Callable[[Any, Any], Any], shared: Any, specs: Sequence[Any], *,
            progress: Callable[[str], None] | None = None, label: Callable[[Any], str] = str) -> list[Any]:
        """``[fn(shared, s) for s in specs]``, run where this sweep says; results in the order of ``specs``. ``progress``
        hears each job's label as it starts (here) or as it finishes (elsewhere)."""
        step = progress or (lambda _m: None)
        specs = list(specs)
        if self.ray_address is not None:
            return self._ray(fn, shared, specs, step, label)
        workers = self.workers(len(specs))
        if workers == 1:
            out = []
            for s in specs:
                step(label(s))
                out.append(fn(shared, s))
            return out
        ctx = get_context("spawn")
        results: list[Any] = [None] * len(specs)
        ex = ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_init_worker, initargs=(shared,))
        futures = {ex.submit(_run_in_worker, fn, s): i for i, s in enumerate(specs)}
        procs = list(getattr(ex, "_processes", {}).values())  # (a broken pool forgets its processes: kept to say how one ended)
        try:
            for fut in as_completed(futures):
                i = futures[fut]
                try:
                    results[i] = fut.result()  # a job's own error (a ConfigError, say) is raised here, as it would be in order
                except BrokenProcessPool:
                    raise SweepWorkerDied(_died(procs, label(specs[i]))) from None
                step(label(specs[i]))
        except BaseException:
            _stop(ex)  # no waiting on workers that may never answer: the error goes up now
            raise
        ex.shutdown(wait=True)
        return results

    def _ray(self, fn: Callable[[Any, Any], Any], shared: Any, specs: list[Any], step: Callable[[str], None],
             label: Callable[[Any], str]) -> list[Any]:
        try:
            import ray
        except ImportError:
            raise ConfigError("--ray", "running a sweep on Ray needs Ray: pip install 'kvpolicy[ray]'") from None
        started = False
        address = self.ray_address
        assert address is not None
        if not ray.is_initialized():
            if self.ray_address == "local":
                ray.init(num_cpus=self.workers(), include_dashboard=False, log_to_driver=False)
            else:
                _check_reachable(address)  # Ray itself retries a dead address for minutes, logging as it goes
                try:
                    ray.init(address=self.ray_address, log_to_driver=False)
                except (ConnectionError, ValueError, RuntimeError) as e:
                    raise ConfigError("--ray", f"could not connect to the Ray cluster at {self.ray_address!r}: {e}") from None
            started = True
        try:
            ref = ray.put(shared)
            remote = ray.remote(_run_on_ray)
            futures = [remote.remote(fn, ref, s) for s in specs]
            index = {f: i for i, f in enumerate(futures)}
            results: list[Any] = [None] * len(specs)
            pending = list(futures)
            while pending:
                done, pending = ray.wait(pending, num_returns=1)
                for f in done:
                    i = index[f]
                    results[i] = ray.get(f)
                    step(label(specs[i]))
            return results
        finally:
            if started:
                ray.shutdown()


def _died(procs: list[Any], job: str) -> str:
    """What a broken pool's dead worker said: its exit code or signal."""
    how = []
    deadline = time.monotonic() + 10.0  # the pool ends the others on its own; each exit status follows within moments
    for p in procs:
        p.join(timeout=max(deadline - time.monotonic(), 0.0))
        # the pool's own thread may be reaping it this instant (its waitpid wins, ours sees no child): ask again
        while p.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)
        code = p.exitcode
        if code is None:
            continue
        if code < 0:
            try:
                how.append(f"killed by {signal.Signals(-code).name}" + (" (the out-of-memory killer's signal?)" if -code == signal.SIGKILL else ""))
            except ValueError:
                how.append(f"killed by signal {-code}")
        else:
            how.append(f"exit code {code}")
    own = [h for h in how if h != "killed by SIGTERM"]  # the pool ends the others with SIGTERM once one has died
    said = ", ".join(sorted(set(own or how))) or "ended abruptly"
    return (f"--jobs: a sweep worker process died without answering ({said}) while the job {job!r} or one beside it ran; "
            "rerun with --jobs 1 to see that job's own error in this process, or with fewer --jobs if memory ran out")


def _stop(ex: ProcessPoolExecutor) -> None:
    """Cancel what has not started and end the workers now."""
    procs = list(getattr(ex, "_processes", {}).values())
    ex.shutdown(wait=False, cancel_futures=True)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
