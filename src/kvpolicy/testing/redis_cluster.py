"""A real Redis Cluster on loopback, for tests and benchmarks: ``LocalRedisCluster(folder).start()`` runs
``masters × (1 + replicas)`` ``redis-server --cluster-enabled yes`` processes (no persistence) and joins them with
``redis-cli --cluster create``; it can kill a master and wait for its replica. Needs redis-server and redis-cli on
PATH."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time


def _free(port: int) -> bool:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False


def cluster_ports(n: int, seed: int | None = None) -> list[int]:
    """n free loopback ports whose cluster-bus twin (port + 10000) is free too."""
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        p = rng.randrange(20000, 50000)
        if p not in out and _free(p) and _free(p + 10000):
            out.append(p)
    return out


class LocalRedisCluster:
    """A real Redis Cluster on loopback: 3 masters, each with one replica (``redis-server --cluster-enabled yes``, then
    ``redis-cli --cluster create``), no persistence; a master can be killed and its replica waited for."""

    NODE_TIMEOUT_MS = 1000

    def __init__(self, tmp: str, masters: int = 3, replicas: int = 1) -> None:
        self.tmp = tmp
        self.ports = cluster_ports(masters * (1 + replicas))
        self.masters, self.replicas = masters, replicas
        self.procs: dict[int, subprocess.Popen[bytes]] = {}

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
