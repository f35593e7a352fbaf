"""``kvpolicy serve-reference``: the reference engine behind an OpenAI-compatible HTTP front end.

Enough of the OpenAI completions API for ``kvpolicy profile --openai-url`` to measure
it exactly as it measures vLLM or SGLang:

* ``POST /v1/completions`` — ``{"model", "prompt": [token ids], "max_tokens", "stream"}``;
  with ``"stream": true`` the first ``data:`` event is sent as soon as prefill ends (the
  first token), then one event per further token, then ``data: [DONE]``. A text prompt
  is refused (400): the reference model has no tokenizer, so callers send token ids —
  which is also what a profile needs, to know its token counts exactly.
* ``GET /v1/models`` — the one model, with its ``vocab_size`` and ``max_model_len``.
* ``GET /metrics`` — Prometheus text: ``kvpolicy_kv_allocated_bytes`` (KV held by the
  paged cache now), ``kvpolicy_kv_capacity_bytes``, ``kvpolicy_kv_block_size_tokens``,
  ``kvpolicy_requests_total``.

One engine serves every request; a lock runs one prefill at a time (one GPU), so
concurrent requests queue as they would on a real replica. Prefix caching is on: a
prompt whose leading blocks were computed before reuses them.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np

from .._io import json_loads
from ..errors import ConfigError
from .model import ModelConfig


class _Handler(BaseHTTPRequestHandler):
    server: ReferenceHTTPServer
    protocol_version = "HTTP/1.1"
    #: seconds a connection may sit between bytes: a client that announces a body and stops sending (or never sends a
    #: request line) releases its thread instead of holding it for ever
    timeout = 30.0

    def setup(self) -> None:
        super().setup()
        # no Nagle: the headers and the first token go out at once (with it, a small write waits
        # for the client's delayed ACK — tens of ms added to every TTFT measured through us)
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        if self.server.verbose:
            super().log_message(format, *args)

    def _send(self, code: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, code: int, message: str) -> None:
        self._send(code, json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code}}).encode())

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        srv = self.server
        if self.path == "/metrics":
            with srv.lock:
                alloc, cap, n = srv.engine.allocated_kv_bytes(), srv.engine.capacity_blocks * srv.engine.block_bytes, srv.requests
            text = (
                "# HELP kvpolicy_kv_allocated_bytes KV bytes held by the paged cache now.\n# TYPE kvpolicy_kv_allocated_bytes gauge\n"
                f"kvpolicy_kv_allocated_bytes {alloc}\n"
                "# HELP kvpolicy_kv_capacity_bytes KV bytes the paged cache can hold.\n# TYPE kvpolicy_kv_capacity_bytes gauge\n"
                f"kvpolicy_kv_capacity_bytes {cap}\n"
                "# TYPE kvpolicy_kv_block_size_tokens gauge\n"
                f"kvpolicy_kv_block_size_tokens {srv.engine.B}\n"
                "# TYPE kvpolicy_requests_total counter\n"
                f"kvpolicy_requests_total {n}\n"
            )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        elif self.path == "/v1/models":
            self._send(200, json.dumps({"object": "list", "data": [{"id": srv.model_name, "object": "model", "owned_by": "kvpolicy",
                                                                     "vocab_size": srv.config.vocab_size, "max_model_len": srv.max_model_len}]}).encode())
        elif self.path in ("/health", "/healthz"):
            self._send(200, b"{}")
        else:
            self._error(404, f"no route {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        srv = self.server
        if self.path != "/v1/completions":
            self._error(404, f"no route {self.path}")
            return
        try:
            n = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            n = -1
        if not 0 <= n <= srv.max_body_bytes:  # read(n) would allocate n bytes (a MemoryError at 1e11), read(-1) to EOF
            self.close_connection = True
            self._error(413 if n > 0 else 400, f"Content-Length: a body of 0 to {srv.max_body_bytes} bytes, got {self.headers.get('Content-Length')!r}")
            return
        try:
            req = json_loads(self.rfile.read(n) or b"{}")
        except (ValueError, json.JSONDecodeError) as exc:
            self._error(400, f"the body is not JSON ({exc})")
            return
        if not isinstance(req, dict):
            self._error(400, "the body must be a JSON object")
            return
        prompt = req.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            self._error(400, "prompt: send a non-empty list of token ids (the reference model has no tokenizer)")
            return
        if max(prompt) >= srv.config.vocab_size or min(prompt) < 0:
            self._error(400, f"prompt: token ids must be in [0, {srv.config.vocab_size})")
            return
        if len(prompt) > srv.max_model_len:
            self._error(400, f"prompt: {len(prompt)} tokens exceed max_model_len {srv.max_model_len}")
            return
        max_tokens = req.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or not 1 <= max_tokens <= 4096:
            self._error(400, "max_tokens: must be an int in [1, 4096]")
            return
        if not isinstance(req.get("stream", False), bool):  # "yes" streamed, 0 did not: a typo would change the protocol
            self._error(400, f"stream: must be true or false, got {req.get('stream')!r}")
            return
        if req.get("model") is not None and not isinstance(req.get("model"), str):
            self._error(400, f"model: must be a string, got {req.get('model')!r}")
            return
        with srv.lock:
            r = srv.engine.prefill(prompt, publish=False)
            srv.requests += 1
        first = int(np.argmax(r.logits[-1])) if r.logits.ndim == 2 else int(np.argmax(r.logits))
        tokens = [first] * max_tokens  # the reference engine prefills; decode is not what it models
        model = req.get("model") or srv.model_name
        if not req.get("stream"):
            body = {"id": f"cmpl-{srv.requests}", "object": "text_completion", "model": model,
                    "choices": [{"index": 0, "text": "".join(f"<{t}>" for t in tokens), "finish_reason": "length"}],
                    "usage": {"prompt_tokens": len(prompt), "completion_tokens": max_tokens, "total_tokens": len(prompt) + max_tokens,
                              "prompt_tokens_details": {"cached_tokens": r.local_blocks * srv.engine.B}}}
            self._send(200, json.dumps(body).encode())
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        try:
            for i, t in enumerate(tokens):
                ev = {"id": f"cmpl-{srv.requests}", "object": "text_completion", "model": model,
                      "choices": [{"index": 0, "text": f"<{t}>", "finish_reason": "length" if i == len(tokens) - 1 else None}]}
                self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client had its first token and left
            pass


class ReferenceHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1", port: int = 8000, *, config: ModelConfig | None = None, block_size_tokens: int = 16,
                 capacity_blocks: int = 16384, model_name: str = "kvpolicy-reference", verbose: bool = False) -> None:
        from .engine import ReferenceEngine

        if not 0 <= port <= 65535:
            raise ConfigError("--port", f"must be in [0, 65535], got {port}")
        self.config = config or ModelConfig()
        self.engine = ReferenceEngine(self.config, block_size_tokens=block_size_tokens, capacity_blocks=capacity_blocks, replica="http")
        self.lock = threading.Lock()
        self.requests = 0
        self.model_name = model_name
        self.max_model_len = (capacity_blocks // 2) * block_size_tokens
        #: the largest request body read: a prompt of max_model_len token ids as JSON (at most 12 bytes each), plus 64 KiB
        self.max_body_bytes = 12 * self.max_model_len + (64 << 10)
        self.verbose = verbose
        super().__init__((host, port), _Handler)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}"

    def start_background(self) -> threading.Thread:
        """Serve from a daemon thread (tests, notebooks); ``shutdown()`` stops it."""
        t = threading.Thread(target=self.serve_forever, name="kvpolicy-serve-reference", daemon=True)
        t.start()
        return t
