"""A throwaway PostgreSQL cluster on a free port (initdb + pg_ctl), which a test may stop, start and wreck.

As root the server must run as the `postgres` user, so the cluster lives in a folder of /tmp that user
owns (pytest's own tmp folders are root's, mode 0700, which postgres cannot enter).
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import create_engine

from consumer.broker import free_port


def _bindir() -> Path:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    assert found, "PostgreSQL's initdb is not installed under /usr/lib/postgresql/*/bin"
    return Path(found[-1]).parent


@dataclass
class PgCluster:
    root: Path
    port: int
    bindir: Path
    paused: bool = False

    @classmethod
    def create(cls) -> "PgCluster":
        root = Path(tempfile.mkdtemp(prefix="lorabatch-adv-pg-"))
        cluster = cls(root, free_port(), _bindir())
        (root / "sock").mkdir()
        if os.geteuid() == 0:
            shutil.chown(root, "postgres")
            shutil.chown(root / "sock", "postgres")
        cluster._run("initdb", "-D", str(root / "data"), "-A", "trust", "-U", "postgres", "-E", "UTF8", "--no-sync")
        return cluster

    def _run(self, tool: str, *args: str, timeout_s: float = 60) -> None:
        prefix = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        done = subprocess.run([*prefix, str(self.bindir / tool), *args], capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"{tool} {' '.join(args)} failed ({done.returncode}): {done.stdout}{done.stderr}"

    def start(self) -> None:
        opts = f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.root / 'sock'} -c fsync=off -c max_connections=100"
        self._run("pg_ctl", "-D", str(self.root / "data"), "-l", str(self.root / "server.log"), "-w", "-t", "30", "-o", opts, "start")

    def stop(self) -> None:
        """A fast shutdown: open sessions are cut off, as in a crash of the database host."""
        self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "fast", "-w", "-t", "30", "stop")

    def pause(self) -> None:
        """Freeze the server's processes (SIGSTOP), as `docker pause` or a hung host does: the connections stay open and
        the kernel takes what is sent on them, but nothing answers, and no error comes."""
        postmaster = self._postmaster()
        os.kill(postmaster, signal.SIGSTOP)  # first: a stopped postmaster starts no backend the loop below would miss
        for child in _children(postmaster):
            os.kill(child, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        """Let a paused server go on (SIGCONT); nothing if it is not paused."""
        if not self.paused:
            return
        postmaster = self._postmaster()
        for child in _children(postmaster):
            os.kill(child, signal.SIGCONT)
        os.kill(postmaster, signal.SIGCONT)
        self.paused = False

    def _postmaster(self) -> int:
        return int((self.root / "data" / "postmaster.pid").read_text().split()[0])

    def url(self, database: str = "postgres") -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a fresh, empty database of this cluster."""
        name = f"adv_{secrets.token_hex(5)}"
        admin = create_engine(self.url(), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as connection:
                connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        finally:
            admin.dispose()
        return self.url(name)

    def execute(self, url: str, *statements: str) -> None:
        engine = create_engine(url, isolation_level="AUTOCOMMIT")
        try:
            with engine.connect() as connection:
                for s in statements:
                    connection.exec_driver_sql(s)
        finally:
            engine.dispose()

    def destroy(self) -> None:
        try:
            self.resume()
            if (self.root / "data" / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop")
        finally:
            shutil.rmtree(self.root, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            fields = Path(stat).read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.split("/")[2]))
    return found
