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


def _cluster_ports(n: int) -> list[int]:
    """n free loopback ports whose cluster-bus twin (port + 10000) is free too."""
    import random

    rng = random.Random()
    out: list[int] = []
    while len(out) < n:
        p = rng.randrange(20000, 50000)
        if p in out:
            continue
        try:
            for q in (p, p + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", q))
        except OSError:
            continue
        out.append(p)
    return out


class RedisClusterUnderTest:
    """A real Redis Cluster on loopback: 3 masters, each with one replica (``redis-server --cluster-enabled yes``, then
    ``redis-cli --cluster create``), no persistence; a master can be killed and its replica waited for."""

    NODE_TIMEOUT_MS = 1000

    def __init__(self, tmp: str, masters: int = 3, replicas: int = 1) -> None:
        self.tmp = tmp
        self.ports = _cluster_ports(masters * (1 + replicas))
        self.masters, self.replicas = masters, replicas
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start(self) -> None:
        for p in self.ports:
            d = os.path.join(self.tmp, str(p))
            os.makedirs(d, exist_ok=True)
            self.procs[p] = subprocess.Popen(
                ["redis-server", "--port", str(p), "--bind", "127.0.0.1", "--cluster-enabled", "yes", "--cluster-config-file",
                 os.path.join(d, "nodes.conf"), "--cluster-node-timeout", str(self.NODE_TIMEOUT_MS), "--save", "", "--appendonly", "no",
                 "--dir", d], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in self.ports:
            for _ in range(200):
                try:
                    with socket.create_connection(("127.0.0.1", p), timeout=0.1):
                        break
                except OSError:
                    time.sleep(0.02)
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports), "--cluster-replicas",
                        str(self.replicas), "--cluster-yes"], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
        self.wait_ok()
        end = time.time() + 30  # a replica takes over only once it has synced with its master
        while time.time() < end:
            roles = [self.cli(p, "info", "replication") for p in self.ports]
            replicas = [r for r in roles if "role:slave" in r]
            views = [self.cli(p, "cluster", "nodes") for p in self.ports]  # and every node knows them as replicas (gossip)
            if (len(replicas) == self.masters * self.replicas and all("master_link_status:up" in r for r in replicas)
                    and all(v.count("slave") == self.masters * self.replicas for v in views)):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster's replicas did not sync")

    def cli(self, port: int, *args: str) -> str:
        return subprocess.run(["redis-cli", "-p", str(port), *args], capture_output=True, text=True, timeout=10).stdout

    def wait_ok(self, timeout_s: float = 30.0) -> None:
        """Until every live node says cluster_state:ok and knows 3 masters with slots."""
        end = time.time() + timeout_s
        while time.time() < end:
            live = [p for p, pr in self.procs.items() if pr.poll() is None]
            if all("cluster_state:ok" in self.cli(p, "cluster", "info") for p in live):
                return
            time.sleep(0.1)
        raise RuntimeError("the Redis Cluster did not reach cluster_state:ok")

    def master_ports(self) -> list[int]:
        out = []
        for line in self.cli(self.live_port(), "cluster", "nodes").splitlines():
            f = line.split()
            if "master" in f[2] and "fail" not in f[2] and len(f) > 8:
                out.append(int(f[1].split(":")[1].split("@")[0]))
        return sorted(out)

    def live_port(self) -> int:
        return next(p for p, pr in self.procs.items() if pr.poll() is None)

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def stop(self) -> None:
        for pr in self.procs.values():
            if pr.poll() is None:
                pr.kill()
                pr.wait()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A private Redis Cluster (3 masters + 3 replicas) for one test module. KVPOLICY_REQUIRE_REDIS_CLUSTER=1 (CI): a
    missing redis-server/redis-cli is a failure, not a skip."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        if os.environ.get("KVPOLICY_REQUIRE_REDIS_CLUSTER"):
            pytest.fail("KVPOLICY_REQUIRE_REDIS_CLUSTER is set but redis-server / redis-cli are not installed")
        pytest.skip("redis-server / redis-cli are not installed (.ci/run installs them)")
    _need_redis()
    c = RedisClusterUnderTest(str(tmp_path_factory.mktemp("cluster")))
    try:
        c.start()
        yield c
    finally:
        c.stop()
