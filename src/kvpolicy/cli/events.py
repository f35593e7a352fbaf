"""Engine-facing commands: ``ingest-events`` (the KV-event sidecar) and ``lookup`` (the directory's answer)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from ..errors import ConfigError
from ._common import _bytes_per_token, _write_report
from .model import _hasher, _read_tokens


# --------------------------------------------------------------------------- ingest-events


def _endpoint_for_rank(endpoint: str, rank: int, flag: str) -> str:
    """vLLM publishes data-parallel rank r on the endpoint's port + r (its replay socket too)."""
    m = re.fullmatch(r"(tcp://[^\s]+):(\d{1,5})", endpoint or "")
    if not m:
        if rank:
            raise ConfigError(flag, f"must be tcp://HOST:PORT with --ranks > 1 (rank r is on PORT + r), got {endpoint!r}")
        if not re.fullmatch(r"(tcp|ipc|inproc)://\S+", endpoint or ""):
            raise ConfigError(flag, f"must be a ZMQ endpoint such as tcp://HOST:PORT, got {endpoint!r}")
        return endpoint
    port = int(m.group(2)) + rank
    if not 0 < port < 65536:
        raise ConfigError(flag, f"port {port} (for rank {rank}) is outside 1..65535")
    return f"{m.group(1)}:{port}"


#: ingest-events: a crashed worker is restarted after this many seconds, doubling with each crash in a row (at most 30 s)
SIDECAR_BACKOFF_S = 0.5


#: ... and the sidecar gives up (exit 1) after this many crashes in a row: a worker that crashes at once every time
SIDECAR_MAX_CRASHES = 8


def _cmd_ingest_events(args: argparse.Namespace) -> int:
    """Feed a directory from an engine's KV events until SIGINT / SIGTERM (or --max-seconds): the sidecar of a pod."""
    import logging
    import signal
    import threading
    import time

    from ..integrations.vllm_events import KVEventIngestor
    from ..integrations.vllm_zmq import ZmqEventSubscriber

    hasher = _hasher(args, "ingest-events")
    bpt = _bytes_per_token(args)[0]
    directory = _directory_from(args.directory)
    if args.ranks > 1024:  # a socket and a thread each: a typo of 10000 would open 10,000 of both
        raise ConfigError("--ranks", f"at most 1024 data-parallel ranks per sidecar, got {args.ranks}")
    for flag, ep in (("--endpoint", args.endpoint), ("--replay-endpoint", args.replay_endpoint)):
        if ep:
            _endpoint_for_rank(ep, args.ranks - 1, flag)  # every rank's port exists, before any socket is opened
    if args.replay_endpoint:  # vLLM offsets both sockets by the rank: 5557 and 5558 put rank 1's events on rank 0's replay
        events = {_endpoint_for_rank(args.endpoint, r, "--endpoint") for r in range(args.ranks)}
        clash = sorted(events & {_endpoint_for_rank(args.replay_endpoint, r, "--replay-endpoint") for r in range(args.ranks)})
        if clash:
            raise ConfigError("--replay-endpoint", f"with --ranks {args.ranks}, {clash[0]} would be both a rank's event socket and "
                                                   "another's replay socket (the engine cannot bind both): put the replay ports "
                                                   "past the event ports' range, e.g. events 5557 and replay 5557 + ranks")
    if args.verify_hash_seed is not None and args.verify is None:
        raise ConfigError("--verify-hash-seed", "only means something with --verify")
    subs = []
    for r in range(args.ranks):
        holder = args.holder if args.ranks == 1 else f"{args.holder}-dp{r}"
        ing = KVEventIngestor(directory, args.tenant, hasher, holder=holder, bytes_per_token=bpt, verify_algo=args.verify,
                              none_hash_seed=args.verify_hash_seed)
        replay = _endpoint_for_rank(args.replay_endpoint, r, "--replay-endpoint") if args.replay_endpoint else None
        try:
            subs.append(ZmqEventSubscriber(ing, _endpoint_for_rank(args.endpoint, r, "--endpoint"), topic=args.topic, replay_endpoint=replay,
                                           on_gap=args.on_gap))
        except ConfigError as e:
            for sub in subs:
                sub.close()
            field = e.field if e.field.startswith("--") else f"--{e.field.replace('_', '-')}"  # the library names its argument
            raise ConfigError(field, e.problem) from None
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    # each refused batch or event is a warning of its own: a bad publisher would flood the sidecar's log, so the stats
    # lines count them by reason and -v shows each — on the events logger alone, put back as it was on the way out
    log = logging.getLogger("kvpolicy.events")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("kvpolicy ingest-events: %(levelname)s: %(message)s"))
    saved = (log.level, log.propagate)
    log.addHandler(handler)
    log.setLevel(logging.WARNING if args.verbose else logging.ERROR)
    log.propagate = False
    restarts = [0] * len(subs)
    last_error: list[str | None] = [None] * len(subs)
    fatal: list[str] = []

    def supervised(i: int, sub: Any) -> None:
        """Run one rank's subscriber; an exception out of it (a directory that raised, a bug) is logged, counted and the
        worker restarted after a backoff — a worker never dies silently. Crashes in a row past SIDECAR_MAX_CRASHES (no
        message handled between them) stop the sidecar, which then exits 1."""
        in_a_row = 0
        while not stop.is_set():
            handled = sub.ingestor.counts["batches"] + sub.ingestor.counts["malformed_frames"]
            try:
                sub.run(stop)
                return
            except Exception as e:  # noqa: BLE001 - whatever it was, the sidecar says so and goes on
                restarts[i] += 1
                last_error[i] = f"{type(e).__name__}: {e}"
                progressed = sub.ingestor.counts["batches"] + sub.ingestor.counts["malformed_frames"] > handled
                in_a_row = 1 if progressed else in_a_row + 1
                print(f"kvpolicy ingest-events: error: rank {i} ({sub.ingestor.holder}) crashed: {last_error[i]} "
                      f"(restarts {restarts[i]}, {in_a_row} in a row)", file=sys.stderr, flush=True)
                if in_a_row >= SIDECAR_MAX_CRASHES:
                    fatal.append(f"rank {i} ({sub.ingestor.holder}) crashed {in_a_row} times in a row, the last: {last_error[i]}")
                    stop.set()
                    return
                stop.wait(min(SIDECAR_BACKOFF_S * 2 ** (in_a_row - 1), 30.0))

    workers = [threading.Thread(target=supervised, args=(i, sub), daemon=True, name=f"kv-events-{i}") for i, sub in enumerate(subs)]

    def stats(final: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"time_s": round(time.time(), 3), "final": final, "ranks": []}
        for i, sub in enumerate(subs):
            ing = sub.ingestor
            out["ranks"].append({"holder": ing.holder, "counts": dict(ing.counts), "refused": {k: v for k, v in ing.refused.items() if v},
                                 "restarts": restarts[i], "last_error": last_error[i]})
        errors = getattr(directory, "errors", None)
        if errors is not None:
            out["directory_errors"] = errors
            out["directory_error_kinds"] = dict(getattr(directory, "error_kinds", {}) or {})
        if final:
            out["fatal"] = fatal[0] if fatal else None
        return out

    for w in workers:
        w.start()
    t_end = time.monotonic() + args.max_seconds if args.max_seconds else None
    next_report = time.monotonic() + args.stats_every_s
    try:
        while not stop.is_set():
            if t_end is not None and time.monotonic() >= t_end:
                break
            stop.wait(0.1)
            if time.monotonic() >= next_report:
                print(json.dumps(stats(False)), flush=True)
                next_report += args.stats_every_s
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=5.0)
        for sub in subs:
            sub.close()
        for sig, old_handler in previous.items():
            signal.signal(sig, old_handler)
        log.removeHandler(handler)
        log.setLevel(saved[0])
        log.propagate = saved[1]
    final = stats(True)
    print(json.dumps(final), flush=True)
    if args.json:
        _write_report(args.json, final)
    if fatal:
        print(f"kvpolicy ingest-events: error: cannot go on: {fatal[0]}", file=sys.stderr, flush=True)
        return 1
    return 0


def _directory_from(url: str) -> Any:
    from ..directory import InMemoryDirectory

    if url == "memory":
        return InMemoryDirectory()
    if re.match(r"^rediss?://", url or ""):
        from ..directory import RedisDirectory

        return RedisDirectory(url=url)
    raise ConfigError("--directory", f"must be redis://HOST:PORT/DB (or rediss://), or 'memory' for a dry run, got {url!r}")


def _cmd_lookup(args: argparse.Namespace) -> int:
    """What the shared directory holds of one prompt: its keys as this deployment builds them, the leading run a
    request would match, and who holds each block — the other end of ingest-events ("why did this request miss?")."""
    from ..integrations.vllm_events import extra_keys_for

    tokens = _read_tokens(args.tokens)
    hasher = _hasher(args, "lookup")
    n = len(tokens) // args.block_size
    extras = extra_keys_for(n, lora_name=args.lora_name, cache_salt=args.cache_salt) if (args.lora_name or args.cache_salt) else None
    keys = list(hasher.hash_blocks(tokens, extra_keys=extras)) if n else []
    directory = _directory_from(args.directory)
    matched = directory.match_prefix(args.tenant, keys) if keys else 0
    rows = directory.lookup(args.tenant, keys) if keys else []
    errors = getattr(directory, "errors", 0)
    if errors:
        raise ConfigError("--directory", f"{args.directory} did not answer ({errors} failed calls): is it up, and does this connection's ACL allow "
                          f"tenant {args.tenant!r}?")
    blocks = [{"index": i, "key": k.hex(), "holders": [{"holder": e.holder, "tier": e.tier, "size_bytes": e.size_bytes,
                                                         "expires_at_s": e.expires_at_s} for e in row]}
              for i, (k, row) in enumerate(zip(keys, rows))]
    report = {"tenant": args.tenant, "block_size_tokens": args.block_size, "num_tokens": len(tokens), "full_blocks": n,
              "matched_blocks": matched, "blocks": blocks}
    if args.json:
        _write_report(args.json, report)
    held = sum(1 for b in blocks if b["holders"])
    print(f"{n} full blocks of {args.block_size} tokens; the directory matches the leading {matched} "
          f"({matched * args.block_size:,} tokens); {held} of them held by someone")
    for b in blocks[: matched + 1] if not args.all else blocks:
        who = ", ".join(f"{h['holder']} ({h['tier']})" for h in b["holders"]) or "nobody: the match stops here"
        print(f"{b['index']:6d}  {b['key']}  {who}")
    if args.json:
        print(f"\nwrote {args.json}")
    return 0
