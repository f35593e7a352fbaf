"""Profile any OpenAI-compatible server (vLLM, SGLang, TGI, a gateway) over streaming ``/v1/completions``.

:class:`OpenAIProfileTarget` is a :class:`~kvpolicy.protocols.ProfileTarget`, so
``kvpolicy profile --openai-url URL --model NAME`` runs the same measurement plan as
on the reference engine and writes the same CSV:

* **cold prefill** — a prompt of ``prefix + tail`` random token ids, the prefix
  unique to this call (nothing can be cached), timed from sending the request to
  the first streamed token (TTFT, ``max_tokens=1``);
* **local hit** — a unique prefix is sent once (which caches it), then the same
  prefix with a new tail is timed;
* **KV bytes** — read from the server's Prometheus ``/metrics`` when it exposes
  the KV its cache holds (``kvpolicy_kv_allocated_bytes``: the reference server),
  as the growth across a cold request of exactly the prefix; otherwise computed
  from ``--config`` / ``--bytes-per-token`` and marked ``computed``. vLLM's
  ``vllm:kv_cache_usage_perc`` is a share of blocks, not bytes, so it cannot
  give bytes per token without the block's size — which is the config again.

Prompts go as token ids, so token counts are exact (no tokenizer round trip).
Ids are drawn from ``[id_low, id_high)``: the server's ``vocab_size`` from
``/v1/models`` when it says, else ``[1000, 30000)`` — ordinary tokens in every
current vocabulary.

Servers that take text only (llama-cpp-python's, ``prompt_format="text"``,
``--prompt-format text``) get text whose token count is still exact: at start the
target asks the server's own tokenizer (``/tokenize``, vLLM's and SGLang's, or
``/extras/tokenize``, llama-cpp-python's) for words that are one token each with
their leading space (`` the``, `` house``), checks that a prompt of 256 of them
tokenizes to exactly 256 tokens plus the fixed special tokens the server adds, and
then writes every prompt as such words — a prefix of words is a prefix of tokens,
so the server's prefix cache sees what it would see with ids. There is no remote-load column: an OpenAI endpoint offers no
way to load a prefix from another replica, so break-even comes from ``kvpolicy
breakeven`` with this profile and your link.
"""

from __future__ import annotations

import math
import re
import threading
import time
import zlib
from typing import Any

import numpy as np

from .errors import ConfigError

#: the most bytes kvpolicy reads of one answer (after decompression): a model list, a tokenizer's answer, /metrics —
#: a 3 GiB body, or a 4 MB gzip body inflating to 4 GiB, each took the profiler past 6 GB
MAX_RESPONSE_BYTES = 16 * 2**20
#: the longest line of a streamed completion (a line that never ends was read whole)
MAX_STREAM_LINE_BYTES = 2**20
#: the largest vocabulary an id prompt draws from (2^31: ids are int32 in every engine)
MAX_VOCAB = 2**31


class ResponseTooLarge(ConfigError):
    """An answer past MAX_RESPONSE_BYTES or a stream line past MAX_STREAM_LINE_BYTES."""


class OpenAIProfileTarget:
    """``timeout_s`` is the deadline of each whole exchange — a request, its answer's headers and its whole body — not of
    one read: a server dripping a byte every 2 s ran for ever under a per-read timeout. A read already waiting when the
    deadline passes ends after at most what was left of the deadline when the exchange began, so an exchange ends
    within twice ``timeout_s`` whatever the server does."""

    has_remote = False

    def __init__(self, url: str, model: str, *, bytes_per_token: int | None = None, seed: int = 0, timeout_s: float = 600.0,
                 api_key: str | None = None, prompt_format: str = "ids") -> None:
        import httpx

        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s <= 86400:
            raise ConfigError("timeout_s", f"must be a number of seconds in (0, 86400], got {timeout_s!r}")
        self.timeout_s = float(timeout_s)

        if not re.match(r"^https?://", url or ""):
            raise ConfigError("--openai-url", f"must start with http:// or https://, got {url!r}")
        if not model:
            raise ConfigError("--model", "name the served model (as the server's /v1/models lists it)")
        self.base = url.rstrip("/")
        if self.base.endswith("/v1"):
            self.base = self.base[:-3]
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # identity: a compressed answer is not asked for (one still sent is inflated a chunk at a time and bounded all the same)
        self.client = httpx.Client(timeout=timeout_s, headers={**headers, "Accept-Encoding": "identity"})
        self._seed = seed
        self._n = 0
        self._lock = threading.Lock()
        self._metrics_lock = threading.Lock()
        status, body = self._exchange("GET", f"{self.base}/v1/models")
        if status != 200:
            raise ConfigError("--openai-url", f"{self.base}/v1/models answered HTTP {status}")
        listing = self._json(body)
        if not isinstance(listing, dict) or not isinstance(listing.get("data", []), list):
            raise ConfigError("--openai-url", f"{self.base}/v1/models did not answer an OpenAI model list: {body[:200]!r}")
        entries: dict[str, Any] = {m["id"]: m for m in listing.get("data", []) if isinstance(m, dict) and isinstance(m.get("id"), str)}
        if model not in entries:
            raise ConfigError("--model", f"{model!r} is not served at {self.base}; it serves {sorted(entries)[:20]}")
        vocab = entries[model].get("vocab_size")
        if vocab is not None and (isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= MAX_VOCAB):
            raise ConfigError("--openai-url", f"{self.base}/v1/models says vocab_size {vocab!r:.40} for {model!r}: "
                                              f"not a vocabulary size in [1, 2^31]")
        self.id_low, self.id_high = (0, vocab) if vocab is not None else (1000, 30000)
        self.kv_bytes_source = "metrics" if self._allocated_bytes() is not None else ("computed" if bytes_per_token else None)
        if self.kv_bytes_source is None:
            raise ConfigError("--config", f"{self.base}/metrics exposes no KV bytes: pass --config or --bytes-per-token to compute them")
        self.bytes_per_token = bytes_per_token
        if prompt_format not in ("ids", "text"):
            raise ConfigError("--prompt-format", f"must be 'ids' or 'text', got {prompt_format!r}")
        self.prompt_format = prompt_format
        self.words: list[str] = []
        self.special_tokens = 0
        if prompt_format == "text":
            self._find_words()

    # ------------------------------------------------------------------ HTTP

    def _exchange(self, method: str, url: str, *, json: object = None, stream_lines: bool = False) -> tuple[int, bytes]:
        """One bounded exchange: (status, body) — the body at most MAX_RESPONSE_BYTES decoded, all of it within the
        deadline. With ``stream_lines``, the body ends at its first ``data:`` line that is not ``[DONE]`` (a streamed
        first token), each line at most MAX_STREAM_LINE_BYTES."""
        import httpx

        try:
            return self._bounded(method, url, json, stream_lines)
        except httpx.HTTPError as exc:  # unreachable, refused, past the deadline: one line naming the server
            raise ConfigError("--openai-url", f"cannot reach {url} or read its answer ({exc})") from None

    def _bounded(self, method: str, url: str, json: object, stream_lines: bool) -> tuple[int, bytes]:
        import httpx

        deadline = time.monotonic() + self.timeout_s
        with self.client.stream(method, url, json=json, timeout=httpx.Timeout(self.timeout_s)) as r:
            got = bytearray()
            scan = 0  # where the next "data:" may start (each byte is looked at a bounded number of times)
            encoding = r.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("identity", "", "gzip", "deflate"):
                raise ConfigError("--openai-url", f"{url} answered in content-encoding {encoding[:40]!r}, which was not asked for")
            # decompressed here, at most the room left: one chunk of a gzip bomb inflates to no more than the bound
            inflate = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS) if encoding in ("gzip", "deflate") else None
            too_large = ResponseTooLarge("--openai-url", f"{url} answered more than {MAX_RESPONSE_BYTES // 2**20} MiB: refused")
            for raw in r.iter_raw():
                if inflate is not None:
                    try:
                        chunk = inflate.decompress(raw, MAX_RESPONSE_BYTES + 1 - len(got))
                    except zlib.error as exc:
                        raise ConfigError("--openai-url", f"{url} answered a corrupt {encoding} body ({exc})") from None
                    if inflate.unconsumed_tail:
                        raise too_large
                else:
                    chunk = raw
                got += chunk
                if time.monotonic() > deadline:
                    raise httpx.ReadTimeout(f"{url}: the answer took longer than the {self.timeout_s:g} s deadline of one exchange")
                if len(got) > MAX_RESPONSE_BYTES:
                    raise too_large
                if stream_lines and r.status_code == 200:
                    while (i := got.find(b"data:", scan)) >= 0:
                        nl = got.find(b"\n", i)
                        if nl < 0:
                            scan = i
                            break
                        if (i == 0 or got[i - 1] == 10) and bytes(got[i + 5:nl]).strip() != b"[DONE]":
                            return r.status_code, bytes(got[:nl])
                        scan = i + 1
                    else:
                        scan = max(scan, len(got) - 4)
                    if len(got) - got.rfind(b"\n") - 1 > MAX_STREAM_LINE_BYTES:
                        raise ResponseTooLarge("--openai-url", f"{url} streamed a line of more than {MAX_STREAM_LINE_BYTES // 2**20} MiB: refused")
            return r.status_code, bytes(got)

    @staticmethod
    def _json(body: bytes) -> object:
        try:
            import json

            return json.loads(body)
        except (ValueError, RecursionError):
            return None

    def _rng(self) -> np.random.Generator:
        with self._lock:
            self._n += 1
            return np.random.default_rng([self._seed, self._n])

    def _ids(self, rng: np.random.Generator, n: int) -> list[int]:
        if self.prompt_format == "text":  # indexes into the one-token words
            return rng.integers(0, len(self.words), n).tolist()
        return rng.integers(self.id_low, self.id_high, n).tolist()

    # ------------------------------------------------------------------ text prompts

    def _tokenize(self, text: str) -> list[int]:
        """The server's own tokenizer: vLLM/SGLang ``/tokenize``, else llama-cpp-python's ``/extras/tokenize``."""
        for path, body, field in (("/tokenize", {"model": self.model, "prompt": text}, "tokens"),
                                  ("/extras/tokenize", {"input": text, "model": self.model}, "tokens")):
            status, got = self._exchange("POST", f"{self.base}{path}", json=body)
            if status == 200:
                answer = self._json(got)
                toks = answer.get(field) if isinstance(answer, dict) else None
                if isinstance(toks, list) and all(isinstance(t, int) for t in toks):
                    return toks
        raise ConfigError("--prompt-format", f"{self.base} has no tokenizer endpoint (/tokenize or /extras/tokenize): text prompts "
                                             "could not be given an exact token count")

    def _find_words(self) -> None:
        # candidate words: letters only, common enough to be single tokens in any BPE vocabulary of 30k+ entries
        base = ("time year people way day man thing woman life child world school state family student group country problem hand "
                "part place case week company system program question work government number night point home water room mother "
                "area money story fact month lot right study book eye job word business issue side kind head house service friend "
                "father power hour game line end member law car city community name president team minute idea kid body information "
                "back parent face others level office door health person art war history party result change morning reason "
                "research girl guy moment air teacher force education").split()
        singles = []
        for w in base:
            if len(self._tokenize(" " + w)) == len(self._tokenize(" " + w + " " + w)) - 1:  # its own token, with the space
                singles.append(" " + w)
            if len(singles) >= 64:
                break
        if len(singles) < 16:
            raise ConfigError("--prompt-format", f"the server's tokenizer splits common words: only {len(singles)} one-token words found")
        self.words = singles
        rng = np.random.default_rng(self._seed)
        probe = rng.integers(0, len(singles), 256).tolist()
        n = len(self._tokenize(self._text(probe)))
        self.special_tokens = n - 256
        if not 0 <= self.special_tokens <= 4 or len(self._tokenize(self._text(probe[:100]))) != 100 + self.special_tokens:
            raise ConfigError("--prompt-format", f"256 one-token words tokenized to {n} tokens: the server's tokenizer does not keep them apart")

    def _text(self, idx: list[int]) -> str:
        return "".join(self.words[i] for i in idx)

    def _ttft_s(self, prompt: list[int]) -> float:
        """Seconds from sending the request to the first streamed token."""
        body = {"model": self.model, "prompt": self._text(prompt) if self.prompt_format == "text" else prompt, "max_tokens": 1,
                "stream": True, "temperature": 0}
        t0 = time.perf_counter()
        status, got = self._exchange("POST", f"{self.base}/v1/completions", json=body, stream_lines=True)
        if status != 200:
            text_only = status in (400, 422, 500) and self.prompt_format == "ids"  # llama-cpp-python's answers 500
            hint = " (a server that takes text prompts only? try --prompt-format text)" if text_only else ""
            raise ConfigError("--openai-url", f"/v1/completions answered HTTP {status}{hint}: {got[:300].decode('utf-8', 'replace')}")
        t = time.perf_counter() - t0
        for line in got.splitlines():
            line = line.strip()
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                return t
        raise ConfigError("--openai-url", "/v1/completions streamed no token")

    def _allocated_bytes(self) -> int | None:
        try:
            status, body = self._exchange("GET", f"{self.base}/metrics")
        except Exception:  # noqa: BLE001 - no metrics endpoint (or one too large or too slow) is an answer, not an error
            return None
        text = body.decode("utf-8", "replace") if status == 200 else ""
        m = re.search(r"^kvpolicy_kv_allocated_bytes(?:\{[^}]*\})?\s+([0-9.eE+]+)\s*$", text, re.M)
        try:
            v = float(m.group(1)) if m else math.nan
        except ValueError:  # "..." matches the pattern and is not a number
            return None
        return int(v) if math.isfinite(v) and v >= 0 else None  # 1e400 is inf: int() would raise

    # ------------------------------------------------------------------ ProfileTarget

    def kv_bytes(self, prefix_tokens: int) -> int:
        if self.kv_bytes_source == "computed":
            assert self.bytes_per_token is not None
            return int(self.bytes_per_token * prefix_tokens)
        with self._metrics_lock:  # nobody else's request may grow the cache between the two reads
            before = self._allocated_bytes()
            self._ttft_s(self._ids(self._rng(), prefix_tokens))
            after = self._allocated_bytes()
        if before is None or after is None or after < before:
            raise ConfigError("--openai-url", f"the server's KV bytes did not grow across a {prefix_tokens}-token request ({before} -> {after}); "
                              "is its cache evicting? pass --config to compute them instead")
        return after - before

    def cold_prefill_s(self, prefix_tokens: int, tail_tokens: int) -> float:
        return self._ttft_s(self._ids(self._rng(), prefix_tokens + tail_tokens))

    #: half hits cache a multiple of this many tokens: a multiple of every common block size
    #: (vLLM 16, SGLang pages, LMCache's 256-token chunks), so the server holds exactly that part
    cache_granule_tokens = 256

    def local_hit_ttft_s(self, prefix_tokens: int, tail_tokens: int, cached_tokens: int | None = None) -> float:
        """The prefix plus a new tail, after a request that shares the prefix's first ``cached_tokens``
        (all of it by default) put them in the server's prefix cache."""
        rng = self._rng()
        prefix = self._ids(rng, prefix_tokens)
        cached = prefix_tokens if cached_tokens is None else cached_tokens
        if not 0 <= cached <= prefix_tokens:
            raise ConfigError("cached_tokens", f"{cached}: must be within the prefix's {prefix_tokens} tokens")
        if cached:
            self._ttft_s(prefix[:cached] + self._ids(rng, tail_tokens))
        return self._ttft_s(prefix + self._ids(rng, tail_tokens))

    def remote_load(self, prefix_tokens: int) -> dict[str, float]:
        # run_profile skips remote loads for targets with has_remote = False; a direct call is refused, not guessed
        raise ConfigError("--openai-url", "an OpenAI endpoint cannot load a prefix from another replica: no remote-load figure to measure; "
                          "give kvpolicy breakeven your link's figures instead")

    def close(self) -> None:
        self.client.close()
