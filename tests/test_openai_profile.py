"""kvpolicy profile --openai-url against the reference engine's HTTP server (kvpolicy serve-reference)."""

import json
import statistics
import time

import numpy as np
import pytest

from kvpolicy.cli import main
from kvpolicy.errors import ConfigError
from kvpolicy.profile import read_profile
from kvpolicy.reference import ModelConfig
from kvpolicy.reference.engine import ReferenceEngine
from kvpolicy.reference.http_server import ReferenceHTTPServer

LENGTHS = [256, 512, 1024]


@pytest.fixture(scope="module")
def server():
    srv = ReferenceHTTPServer(port=0, capacity_blocks=8192)
    srv.start_background()
    yield srv
    srv.shutdown()
    srv.server_close()


def run(capsys, *argv):
    rc = main(list(argv))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_profile_over_http_agrees_with_the_engine_in_process_and_drives_compare(server, capsys, tmp_path):
    csv = tmp_path / "http_profile.csv"
    rc, out, err = run(capsys, "profile", "--openai-url", server.url, "--model", "kvpolicy-reference", "--lengths", ",".join(map(str, LENGTHS)),
                       "--concurrency", "1,2", "--repeats", "5", "--out", str(csv), "-q")
    assert rc == 0, err
    assert "KV bytes read from /metrics" in out and "break-even       not measured" in out
    prof = read_profile(csv)
    # KV bytes came from the server's own accounting: exactly the engine's 512 B/token
    cfg = ModelConfig()
    assert prof.kv_bytes.tolist() == [L * cfg.geometry().bytes_per_token for L in LENGTHS]
    # cold prefill over HTTP = the engine's own prefill time plus a little HTTP, within noise: the HTTP
    # median must fall inside the in-process samples' range, widened 2x (+15 ms of HTTP) for a busy machine
    eng = ReferenceEngine(cfg, block_size_tokens=16, capacity_blocks=8192)
    rng = np.random.default_rng(3)
    for i, L in enumerate(LENGTHS):
        ts = []
        for _ in range(5):
            eng.reset()
            toks = rng.integers(0, cfg.vocab_size, L + 16)
            t0 = time.perf_counter()
            eng.prefill(toks, publish=False)
            ts.append(time.perf_counter() - t0)
        lo_ms, hi_ms = min(ts) * 1e3, max(ts) * 1e3
        http_ms = prof.cold_prefill_ms[i]
        assert 0.5 * lo_ms <= http_ms <= 2.0 * hi_ms + 15.0, (L, http_ms, lo_ms, hi_ms, statistics.median(ts) * 1e3)
    # a local hit over HTTP is faster than a cold prefill at the longest prefix: the server really caches
    assert prof.local_hit_ttft_ms[-1] < prof.cold_prefill_ms[-1]
    assert "cold_prefill_c2_p50_ms" in prof.extra and "remote_load_p50_ms" not in prof.extra
    # half hits cache whole 256-token granules of the prefix: none at 256, then half of it
    assert prof.extra["half_hit_cached_tokens"].tolist() == [0, 256, 512]
    assert prof.extra["half_hit_ttft_ms"][-1] < prof.cold_prefill_ms[-1], "half the prefix was served from the server's cache"
    assert prof.extra["half_hit_ttft_ms"][-1] > prof.local_hit_ttft_ms[-1], "and only half: the other 512 tokens were recomputed"
    # the CSV drives compare with its own model (512 B/token)
    rc, out, err = run(capsys, "compare", "--profile", str(csv), "--bytes-per-token", "512", "--scenario", "steady", "--policies", "kvpolicy", "-q")
    assert rc == 0, err
    assert "steady" in out and "kvpolicy" in out


def test_profile_openai_refusals(server, capsys):
    rc, _, err = run(capsys, "profile", "--openai-url", server.url, "--model", "nope", "--lengths", "256", "-q")
    assert rc == 2 and "--model" in err and "kvpolicy-reference" in err
    rc, _, err = run(capsys, "profile", "--openai-url", "ftp://x", "--model", "m", "--lengths", "256", "-q")
    assert rc == 2 and "--openai-url" in err
    rc, _, err = run(capsys, "profile", "--openai-url", "http://127.0.0.1:9", "--model", "m", "--lengths", "256", "-q")
    assert rc == 2 and "cannot reach" in err
    rc, _, err = run(capsys, "profile", "--model", "m", "--lengths", "256", "-q")
    assert rc == 2 and "--openai-url" in err


def test_server_refuses_text_and_out_of_vocab_prompts(server):
    import httpx

    r = httpx.post(server.url + "/v1/completions", json={"model": "kvpolicy-reference", "prompt": "hello"})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 10**9]})
    assert r.status_code == 400 and "[0, 4096)" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", content=b"{not json")
    assert r.status_code == 400
    # a truthy "yes" streamed and a 0 did not; a numeric model was echoed back as the model's name
    for bad, field in (({"stream": "yes"}, "stream"), ({"model": 7}, "model")):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": [1, 2, 3], **bad})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(field + ":")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": list(range(100)), "max_tokens": 2})
    body = r.json()
    assert r.status_code == 200 and body["usage"]["prompt_tokens"] == 100 and body["usage"]["completion_tokens"] == 2
    metrics = httpx.get(server.url + "/metrics").text
    assert "kvpolicy_kv_allocated_bytes" in metrics and json.loads(httpx.get(server.url + "/v1/models").text)["data"][0]["vocab_size"] == 4096


def test_computed_kv_bytes_when_metrics_say_nothing(server, monkeypatch):
    from kvpolicy.openai_profile import OpenAIProfileTarget

    monkeypatch.setattr(OpenAIProfileTarget, "_allocated_bytes", lambda self: None)
    with pytest.raises(ConfigError, match="--config"):
        OpenAIProfileTarget(server.url, "kvpolicy-reference")
    t = OpenAIProfileTarget(server.url, "kvpolicy-reference", bytes_per_token=131072)
    assert t.kv_bytes_source == "computed" and t.kv_bytes(1024) == 1024 * 131072
    with pytest.raises(ConfigError, match="another replica"):
        t.remote_load(256)
    t.close()


def test_the_server_bounds_what_a_client_can_make_it_hold(server, monkeypatch):
    """serve-reference listens on a port: a Content-Length of 1e11 made it try to read (allocate) 100 GB — a
    MemoryError in the handler — a negative one read to EOF, and a client that announces a body and stops sending
    held a thread for ever. Now: 413/400 before reading, and an idle connection is dropped after the handler's timeout."""
    import socket

    from kvpolicy.reference import http_server

    host, port = server.server_address[:2]

    def raw(request: bytes) -> bytes:
        with socket.create_connection((host, port), timeout=10) as s:
            s.sendall(request)
            return s.recv(4096)

    for length, code in (("99999999999", b"413"), ("-5", b"400"), ("abc", b"400")):
        reply = raw(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {length}\r\n\r\nx".encode())
        assert reply.split(b"\r\n")[0].split(b" ")[1] == code and b"Content-Length" in reply
    assert server.max_body_bytes == 12 * server.max_model_len + (64 << 10)
    assert http_server._Handler.timeout is not None and 0 < http_server._Handler.timeout <= 60  # the stdlib's default is None: wait for ever
    monkeypatch.setattr(http_server._Handler, "timeout", 0.5)
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"pro")  # then silence
        t0 = time.perf_counter()
        assert s.recv(4096) == b""  # the server hung up on the idle client
        assert time.perf_counter() - t0 < 5


def test_a_server_that_answers_nonsense_is_named_not_a_traceback():
    """A /v1/models that is not an OpenAI model list (an HTML page, a bare list) was a JSONDecodeError or an
    AttributeError; a /metrics gauge of 1e400 was an OverflowError from int(inf). Each is now a ConfigError naming
    --openai-url, or (for the gauge) no metrics — what --config is for."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvpolicy.openai_profile import OpenAIProfileTarget

    answers = {}

    class H(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            body = answers.get(self.path, b"").encode() if isinstance(answers.get(self.path, b""), str) else answers.get(self.path, b"")
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        for listing in ("<html>oops</html>", "[1, 2]", '{"data": "m"}'):
            answers["/v1/models"] = listing
            with pytest.raises(ConfigError, match="did not answer an OpenAI model list"):
                OpenAIProfileTarget(url, "m")
        answers["/v1/models"] = '{"data": [{"id": "m"}]}'
        answers["/metrics"] = "kvpolicy_kv_allocated_bytes 1e400\n"
        with pytest.raises(ConfigError, match="exposes no KV bytes"):  # no usable gauge: asks for --config
            OpenAIProfileTarget(url, "m")
        assert OpenAIProfileTarget(url, "m", bytes_per_token=512).kv_bytes_source == "computed"
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_hostile_server_cannot_hold_the_profiler_for_ever_or_fill_its_memory():
    """Round three: a server dripping one byte every 2 s kept `profile --openai-url` running for ever (the timeout was
    per read); a 3 GiB body, a stream line that never ends and a small gzip body inflating to GiBs each took it past
    6 GB; `"vocab_size": 10**30` was a traceback. Each exchange now has a deadline for the whole of it, every answer is
    read at most MAX_RESPONSE_BYTES (after decompression), a streamed line at most MAX_STREAM_LINE_BYTES, and the
    vocabulary is checked — each a ConfigError naming --openai-url."""
    import gzip
    import threading
    import time
    import tracemalloc
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvpolicy import openai_profile
    from kvpolicy.openai_profile import OpenAIProfileTarget

    mode = {"models": '{"data": [{"id": "m"}]}', "completions": "drip"}
    bomb = gzip.compress(b"\n" * (64 * 2**20), compresslevel=9)  # ~64 KiB inflating to 64 MiB of empty lines

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self):  # noqa: N802
            body = mode["models"].encode() if self.path == "/v1/models" else b""
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            how = mode["completions"]
            self.send_response(200)
            try:
                if how == "drip":
                    self.send_header("Content-Length", "1000")
                    self.end_headers()
                    for _ in range(1000):
                        self.wfile.write(b" ")
                        self.wfile.flush()
                        time.sleep(0.2)
                elif how == "huge":
                    self.send_header("Content-Length", str(3 * 2**30))
                    self.end_headers()
                    for _ in range(3 * 2**30 // 2**20):
                        self.wfile.write(b"\n" * 2**20)  # empty lines: only the body's own bound stops it
                elif how == "endless-line":
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    for _ in range(64):  # (a megabyte at a time: this server's own memory is traced too)
                        self.wfile.write(b"x" * 2**20)
                elif how == "gzip":
                    self.send_header("Content-Encoding", "gzip")
                    self.send_header("Content-Length", str(len(bomb)))
                    self.end_headers()
                    self.wfile.write(bomb)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        t = OpenAIProfileTarget(url, "m", bytes_per_token=512, timeout_s=1.0)
        t0 = time.perf_counter()
        with pytest.raises(ConfigError) as e:
            t.cold_prefill_s(16, 4)
        assert e.value.field == "--openai-url" and "deadline" in str(e.value)
        assert time.perf_counter() - t0 < 2 * t.timeout_s + 1.0
        t.timeout_s = 60.0
        for how, what in (("huge", "more than 16 MiB"), ("endless-line", "a line of more than 1 MiB"), ("gzip", "more than 16 MiB")):
            mode["completions"] = how
            tracemalloc.start()
            with pytest.raises(ConfigError, match=what):
                t.cold_prefill_s(16, 4)
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            assert peak < openai_profile.MAX_RESPONSE_BYTES * 4, (how, peak)
        t.close()
        for vocab in ("10" + "0" * 30, "-5", "true", "1.5"):
            mode["models"] = '{"data": [{"id": "m", "vocab_size": %s}]}' % vocab
            with pytest.raises(ConfigError, match="vocab_size") as e:
                OpenAIProfileTarget(url, "m", bytes_per_token=512)
            assert e.value.field == "--openai-url"
        mode["models"] = '{"data": [{"id": "m", "vocab_size": 32000}]}'
        assert OpenAIProfileTarget(url, "m", bytes_per_token=512).id_high == 32000
    finally:
        srv.shutdown()
        srv.server_close()
