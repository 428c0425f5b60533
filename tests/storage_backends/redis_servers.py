"""Real `redis-server` processes for the tests: a single server (TCP or unix socket) and a
3-node Redis Cluster, on free loopback ports in a temp dir, always stopped on exit.

`redis-server` / `redis-cli` come from Debian's `redis-server` / `redis-tools` packages
(scripts/install_system_deps.sh installs them when missing).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from tests.procs import ManagedProcess, free_port, wait_for_port

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
HAVE_REDIS = REDIS_SERVER is not None and REDIS_CLI is not None
SKIP_REASON = "redis-server / redis-cli not installed (run scripts/install_system_deps.sh)"


def make_test_certs(workdir: Path) -> Path:
    """A throw-away CA and a server certificate for 127.0.0.1 (openssl CLI); returns the dir
    holding ca.crt, server.crt and server.key."""
    workdir.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=workdir, capture_output=True, check=True,
                       timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "2", "-subj", "/CN=hicache-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (workdir / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "2", "-extfile", "san.ext")
    return workdir


def _ping(port: int | None = None, unixsocket: Path | None = None, timeout: float = 1.0,
          cafile: Path | None = None) -> bool:
    try:
        if unixsocket is not None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(timeout)
            s.connect(str(unixsocket))
        else:
            s = socket.create_connection(("127.0.0.1", port or 0), timeout=timeout)
            if cafile is not None:
                ctx = ssl.create_default_context(cafile=str(cafile))
                s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
        with s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RestartableServer:
    """A server process on a loopback port that `stop()` (SIGTERM) and `kill()` (SIGKILL) end
    and a subclass's `start()` brings back; `proc` is the current process, `starts` counts
    the starts (for per-start log names)."""

    def __init__(self) -> None:
        self.proc: ManagedProcess | None = None
        self.starts = 0

    def alive(self) -> bool:
        return self.proc is not None and self.proc.alive()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()

    def kill(self) -> None:
        """SIGKILL: the way a crashed or OOM-killed server goes."""
        if self.proc is not None:
            self.proc.kill()


class RedisServer(RestartableServer):
    """One `redis-server` bound to 127.0.0.1 (and/or a unix socket), no persistence.

    `tls`: a directory from `make_test_certs`; the port then speaks TLS only.
    `stop()` / `kill()` end it; `start()` brings it back on the same port (empty)."""

    def __init__(self, workdir: Path, *, port: int | None = None, unixsocket: bool = False,
                 cluster_port: int | None = None, args: tuple[str, ...] = (),
                 tls: Path | None = None) -> None:
        if not HAVE_REDIS:
            raise RuntimeError(SKIP_REASON)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port if port is not None else free_port()
        self.unixsocket = workdir / "redis.sock" if unixsocket else None
        self.cluster_port = cluster_port
        self.args = args
        self.tls = tls
        super().__init__()

    @property
    def url(self) -> str:
        if self.tls is not None:
            return (f"rediss://127.0.0.1:{self.port}/0?ssl_cert_reqs=required"
                    f"&ssl_ca_certs={self.tls / 'ca.crt'}")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def unix_url(self) -> str:
        assert self.unixsocket is not None
        return f"unix://{self.unixsocket}?db=0"

    def argv(self) -> list[str]:
        assert REDIS_SERVER is not None
        argv = [
            REDIS_SERVER,
            "--bind", "127.0.0.1",
            "--port", "0" if self.tls is not None else str(self.port),
            "--dir", str(self.workdir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", "",
        ]
        if self.unixsocket is not None:
            argv += ["--unixsocket", str(self.unixsocket), "--unixsocketperm", "700"]
        if self.tls is not None:
            argv += [
                "--tls-port", str(self.port),
                "--tls-cert-file", str(self.tls / "server.crt"),
                "--tls-key-file", str(self.tls / "server.key"),
                "--tls-ca-cert-file", str(self.tls / "ca.crt"),
                "--tls-auth-clients", "no",
            ]
        if self.cluster_port is not None:
            argv += [
                "--cluster-enabled", "yes",
                "--cluster-config-file", str(self.workdir / "nodes.conf"),
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(self.cluster_port),
            ]
        return argv + list(self.args)

    def start(self, timeout: float = 20.0) -> RedisServer:
        if self.alive():
            return self
        self.starts += 1
        self.proc = ManagedProcess(self.argv(), self.workdir / f"redis-{self.starts}.log").start()
        wait_for_port(self.port, timeout=timeout, proc=self.proc.proc)
        deadline = time.monotonic() + timeout
        cafile = self.tls / "ca.crt" if self.tls is not None else None
        while not _ping(self.port, cafile=cafile):
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} never answered PING:\n"
                                   f"{self.proc.log()[-2000:]}")
            time.sleep(0.05)
        return self

    def cli(self, *args: str) -> str:
        assert REDIS_CLI is not None
        tls: list[str] = []
        if self.tls is not None:
            tls = ["--tls", "--cacert", str(self.tls / "ca.crt")]
        r = subprocess.run([REDIS_CLI, "-h", "127.0.0.1", "-p", str(self.port), *tls, *args],
                           capture_output=True, text=True, timeout=30, check=True)
        return r.stdout

    def log(self) -> str:
        return self.proc.log() if self.proc is not None else ""


@contextmanager
def redis_server(workdir: Path, *, unixsocket: bool = False, args: tuple[str, ...] = (),
                 tls: Path | None = None) -> Iterator[RedisServer]:
    server = RedisServer(workdir, unixsocket=unixsocket, args=args, tls=tls)
    try:
        yield server.start()
    finally:
        server.stop()


def _free_port_pair() -> tuple[int, int]:
    a = free_port()
    b = free_port()
    while b == a:
        b = free_port()
    return a, b


class RedisCluster:
    """Three primaries (no replicas) covering all 16384 slots."""

    def __init__(self, nodes: list[RedisServer]) -> None:
        self.nodes = nodes

    @property
    def url(self) -> str:
        """A `redis+cluster://` URL naming every node."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    @property
    def seed_url(self) -> str:
        """A plain URL of one node (for `{"cluster": true}`)."""
        return self.nodes[0].url

    def dbsizes(self) -> list[int]:
        return [int(n.cli("DBSIZE").strip()) for n in self.nodes]

    def wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            states = [n.cli("CLUSTER", "INFO") for n in self.nodes]
            if all("cluster_state:ok" in s for s in states):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster never became ok: {states}")
            time.sleep(0.1)


@contextmanager
def redis_cluster(workdir: Path, n: int = 3) -> Iterator[RedisCluster]:
    """Start `n` cluster-enabled servers and join them with `redis-cli --cluster create`."""
    assert REDIS_CLI is not None
    with ExitStack() as stack:
        nodes: list[RedisServer] = []
        for i in range(n):
            port, bus = _free_port_pair()
            node = RedisServer(workdir / f"node{i}", port=port, cluster_port=bus)
            stack.callback(node.stop)
            nodes.append(node.start())
        subprocess.run(
            [REDIS_CLI, "--cluster", "create",
             *[f"127.0.0.1:{node.port}" for node in nodes],
             "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True, text=True, timeout=60, check=True,
        )
        cluster = RedisCluster(nodes)
        cluster.wait_ok()
        yield cluster
