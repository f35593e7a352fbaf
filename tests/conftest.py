import os

from hypothesis import HealthCheck, settings

settings.register_profile("ci", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# a bug hunt by hand, not CI: HYPOTHESIS_PROFILE=deep python -m pytest tests/test_eviction.py ... (tests that pin their
# own max_examples keep it)
settings.register_profile("deep", max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


# --------------------------------------------------------------------------- a real redis-server for the directory tests

import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A private redis-server on loopback (no persistence), restartable on the same port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.1):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _need_redis() -> None:
    if shutil.which("redis-server") is None:
        if os.environ.get("KVPOLICY_REQUIRE_REDIS"):
            pytest.fail("KVPOLICY_REQUIRE_REDIS is set but redis-server is not installed")
        pytest.skip("redis-server is not installed (.ci/run installs it)")
    try:
        import redis  # noqa: F401
    except ImportError:
        if os.environ.get("KVPOLICY_REQUIRE_REDIS"):
            pytest.fail("KVPOLICY_REQUIRE_REDIS is set but redis-py is not installed")
        pytest.skip("redis-py is not installed")


@pytest.fixture(scope="session")
def redis_url():
    """KVPOLICY_REDIS_URL (the server .ci/run starts) or a private server for the session."""
    url = os.environ.get("KVPOLICY_REDIS_URL")
    if url:
        yield url
        return
    _need_redis()
    srv = RedisServer()
    srv.start()
    yield srv.url
    srv.stop()


@pytest.fixture
def redis_server():
    """A private, restartable redis-server for one test."""
    _need_redis()
    srv = RedisServer()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A private Redis Cluster (3 masters + 3 replicas) for one test module. KVPOLICY_REQUIRE_REDIS_CLUSTER=1 (CI): a
    missing redis-server/redis-cli is a failure, not a skip."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if os.environ.get("KVPOLICY_REQUIRE_REDIS_CLUSTER"):
            pytest.fail("KVPOLICY_REQUIRE_REDIS_CLUSTER is set but redis-server / redis-cli are not installed")
        pytest.skip("redis-server / redis-cli are not installed (.ci/run installs them)")
    _need_redis()
    from kvpolicy.testing.redis_cluster import LocalRedisCluster

    c = LocalRedisCluster(str(tmp_path_factory.mktemp("cluster")))
    try:
        c.start()
        yield c
    finally:
        c.stop()
