"""The L3 adapter store: a directory of PEFT adapters, content-addressed by sha256.

An adapter is exactly two files, `adapter_config.json` and `adapter_model.safetensors` (safetensors
only: pickle-based `.bin` weights can run code when loaded). Its identity is

    sha256( b"lorabatch-adapter-v1\\n"
            + for NAME in ("adapter_config.json", "adapter_model.safetensors"):   # fixed order
                  NAME + b"\\n" + len(BYTES) as 8-byte big-endian + BYTES )

over the files' raw bytes. It depends on nothing the filesystem adds (order of directory entries,
times, permissions, other files in the folder), and the length prefixes make the framing unambiguous:
no two different pairs of files hash alike short of a sha256 collision. The same content under two
names is one entry, one copy; the engine uses the same hash to load it once.

Layout: `root/<sha256>/adapter_config.json` and `root/<sha256>/adapter_model.safetensors`. `put` writes
into `root/.tmp-<random>/` and renames it into place, so a reader never sees half an entry, and hashes
the bytes it writes, so a source that changes mid-copy cannot yield an entry that disagrees with its name.
Putting content whose entry is there but no longer holds it (its files changed or damaged on disk) replaces the
entry's files, so `lorabatch adapters add` of the adapter's folder repairs the entry.
`put_bytes` stores bytes already read and validated (engine.adapter_import: read once, hashed, checked against the
base, written) the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from safetensors import SafetensorError, safe_open

from engine.api import AdapterError

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
_FILES = (CONFIG_NAME, WEIGHTS_NAME)  # the hash's fixed order
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_HASH_DOMAIN = b"lorabatch-adapter-v1\n"
_SHA_RE = re.compile(r"[0-9a-f]{64}\Z")  # \Z: "$" would also match before a final newline
_CHUNK = 1 << 20


def content_sha256(config: bytes, weights: bytes) -> str:
    """The adapter identity of the module docstring, from the two files' bytes."""
    h = hashlib.sha256(_HASH_DOMAIN)
    for name, data in zip(_FILES, (config, weights)):
        h.update(_frame(name, len(data)))
        h.update(data)
    return h.hexdigest()


def read_file(path: Path, max_bytes: int) -> bytearray:
    """A file's bytes, read into a writable buffer (engine.adapters.read_safetensors views tensors in it without a copy),
    no more than its size when opened: a file that grows meanwhile is read to that size (what is read is what is hashed
    and checked). A file over `max_bytes` when opened (swapped for a larger one after adapter_files checked its size) is
    refused before any of it is read, where its whole size was allocated."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise AdapterError(f"{path} takes {size} bytes, over the {max_bytes} left to it of engine.max_adapter_bytes "
                               "(the adapter's files together); lower the adapter's rank or raise the limit",
                               code="adapter_too_large")
        buf = bytearray(size)
        got = f.readinto(buf)
    if got < len(buf):  # shrank meanwhile: what is left (read_safetensors refuses it as truncated)
        del buf[got:]
    return buf


def open_regular(path: Path | str, unfit: Callable[[int], Exception] | None = None) -> BinaryIO:
    """`path` opened for reading, refused unless what was opened is a regular file: `unfit(st_mode)` is raised, by default
    AdapterError (adapter_unsafe). A check before the open (`is_file()`) is not enough: a FIFO swapped in after it blocked
    the reader's open for ever, waiting for a writer, and a device such as /dev/zero never ends. So the open does not wait
    (O_NONBLOCK: a FIFO with no writer opens at once) and the opened descriptor is what is checked; a regular file is then
    read as any other. OSError for one that cannot be opened."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            if unfit is not None:
                raise unfit(mode)
            raise AdapterError(f"{path} is not a regular file (a FIFO, device, socket or folder: reading it might never end); "
                               "replace it with the adapter's file", code="adapter_unsafe")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def adapter_files(src_dir: Path, max_bytes: int) -> tuple[Path, Path]:
    """Check that `src_dir` is a safe PEFT adapter folder; return its (config, weights) paths.

    Refuses: a missing folder or file, pickle weights anywhere in the folder, a symlink leading out of
    the folder, anything that is not a regular file, and files together larger than `max_bytes`.
    """
    src_dir = Path(src_dir)
    if not src_dir.is_dir():
        what = "is not a folder" if src_dir.exists() or src_dir.is_symlink() else "does not exist"  # a file, or a dangling or looping link
        raise AdapterError(f"{src_dir}: {what}; pass the adapter folder, the one holding {CONFIG_NAME}", code="adapter_missing")
    top = src_dir.resolve()
    for dirpath, _dirs, names in os.walk(src_dir):
        for name in names:
            if name.lower().endswith(_PICKLE_SUFFIXES):
                raise AdapterError(
                    f"{Path(dirpath) / name}: pickle-based weights are refused (they can run code when loaded); "
                    f"convert the adapter to {WEIGHTS_NAME}, e.g. with peft's save_pretrained(safe_serialization=True), "
                    "and remove the pickle file",
                    code="adapter_unsafe",
                )
    paths = []
    for name in _FILES:
        path = src_dir / name
        if not path.exists():
            raise AdapterError(
                f"{path} is missing; a PEFT adapter folder holds {CONFIG_NAME} and {WEIGHTS_NAME} "
                "(save it with peft's save_pretrained)",
                code="adapter_missing",
            )
        real = path.resolve()
        if not real.is_relative_to(top):
            raise AdapterError(
                f"{path} is a symlink to {real}, outside the adapter folder {top}; copy the file into the folder",
                code="adapter_unsafe",
            )
        if not real.is_file():
            raise AdapterError(f"{path} is not a regular file; replace it with the adapter's file", code="adapter_unsafe")
        paths.append(real)
    total = sum(p.stat().st_size for p in paths)
    if total > max_bytes:
        raise AdapterError(
            f"{src_dir}: adapter files take {total} bytes, over the limit of {max_bytes} "
            "(engine.max_adapter_bytes); lower the adapter's rank or raise the limit",
            code="adapter_too_large",
        )
    return paths[0], paths[1]


class AdapterStore:
    """Adapters on disk under `root`, one folder per content hash; `max_bytes` caps one adapter's files."""

    def __init__(self, root: Path, max_bytes: int):
        assert max_bytes > 0, max_bytes
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def put(self, src_dir: Path) -> str:
        """Validate and copy an adapter folder into the store; return its sha256 (idempotent)."""
        config_path, weights_path = adapter_files(src_dir, self.max_bytes)
        _check_config_json(read_file(config_path, self.max_bytes), config_path)
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            h = hashlib.sha256(_HASH_DOMAIN)
            for name, src in zip(_FILES, (config_path, weights_path)):
                _copy_hashing(src, tmp / name, name, h)
            _check_safetensors_header(tmp / WEIGHTS_NAME, weights_path)
            sha = h.hexdigest()
            self._install(tmp, sha)
            return sha
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)

    def put_bytes(self, config: bytes, weights: bytes) -> tuple[str, bool]:
        """Store an adapter's two files from their bytes, already validated (engine.adapters.parse_adapter: this checks
        nothing); return (sha256, whether this call wrote the entry). Content already stored is not written again, unless the
        entry's files no longer hold it (`_install` repairs them)."""
        sha = content_sha256(config, weights)
        if (self.root / sha).is_dir() and self._holds(sha, (config, weights)):
            self._touch(sha)
            return sha, False
        tmp = self.root / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        try:
            for name, data in zip(_FILES, (config, weights)):
                with open(tmp / name, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            return sha, self._install(tmp, sha)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)

    def _holds(self, sha: str, contents: tuple[bytes, bytes]) -> bool:
        """Whether entry `sha`'s two files hold exactly `contents` (config, weights), as files of their own (a link is
        refused by a store read, adapter_unsafe, whatever it leads to)."""
        for name, data in zip(_FILES, contents):
            path = self.root / sha / name
            try:
                if path.is_symlink() or path.stat().st_size != len(data) or read_file(path, len(data)) != data:
                    return False
            except (OSError, AdapterError):  # missing, or not a regular file (refused by read_file's open)
                return False
        return True

    def _install(self, tmp: Path, sha: str) -> bool:
        """Rename the written folder `tmp` into place as `sha`; False when the entry was there already (`tmp` is left
        for the caller to remove). An entry there whose files no longer hold its content (changed or damaged on disk:
        workers fail its adapter with adapter_changed) gets `tmp`'s files in their place, one atomic replace each, so
        that putting the adapter again repairs it (True)."""
        final = self.root / sha
        if final.exists():
            if not self._holds(sha, tuple((tmp / name).read_bytes() for name in _FILES)):
                for name in _FILES:
                    os.replace(tmp / name, final / name)
                self._touch(sha)
                return True
            self._touch(sha)
            return False
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():  # a concurrent put of the same content wins the race; anything else is real
                raise
            return False
        return True

    def _touch(self, sha: str) -> None:
        """Content put again: its entry counts as just written, so that a prune (`entries`, `remove`) racing with the
        registration that follows this put leaves it alone for its grace period."""
        try:
            os.utime(self.root / sha)
        except OSError:  # gone, or a store this user may not write times in (a shared, read-only one): nothing to renew
            pass

    def path(self, sha: str) -> Path:
        """The folder of a stored adapter."""
        folder = self.root / _check_sha(sha)
        if not folder.is_dir():
            raise AdapterError(f"adapter {sha} is not in the store {self.root}; put it first", code="adapter_missing")
        return folder

    def verify(self, sha: str) -> None:
        """Re-hash a stored adapter; raise AdapterError(adapter_corrupt) if its files no longer match its name."""
        folder = self.path(sha)
        h = hashlib.sha256(_HASH_DOMAIN)
        for name in _FILES:
            path = folder / name
            if not path.is_file():
                raise AdapterError(f"{path} is missing from the store; delete {folder} and put the adapter again", code="adapter_corrupt")
            _copy_hashing(path, None, name, h)
        if h.hexdigest() != sha:
            raise AdapterError(
                f"{folder}: content hashes to {h.hexdigest()}, not its name {sha}; the files were changed or damaged "
                "on disk: delete the folder and put the adapter again",
                code="adapter_corrupt",
            )

    def __contains__(self, sha: str) -> bool:
        return bool(_SHA_RE.match(sha)) and (self.root / sha).is_dir()

    def entries(self) -> list[StoreEntry]:
        """Every folder in the store: its entries (named by a sha256) and the unfinished writes a crashed `put` left
        (`.tmp-*`), with their bytes and age. Anything else in the root is not the store's and is not listed."""
        out = []
        with os.scandir(self.root) as it:
            for d in it:
                if not d.is_dir(follow_symlinks=False) or not (_SHA_RE.match(d.name) or d.name.startswith(".tmp-")):
                    continue
                try:
                    files = [f.stat(follow_symlinks=False) for f in os.scandir(d.path)]
                    mtime = d.stat(follow_symlinks=False).st_mtime
                except FileNotFoundError:  # removed meanwhile
                    continue
                out.append(StoreEntry(d.name, Path(d.path), sum(f.st_size for f in files), mtime, d.name.startswith(".tmp-")))
        return sorted(out, key=lambda e: e.name)

    def remove(self, entry: StoreEntry, *, unless_newer_than: float | None = None) -> bool:
        """Delete an entry's folder: renamed aside first, so a reader never finds half an entry under its name. With
        `unless_newer_than`, an entry written or put again after that time (a registration racing the caller) is put
        back. Returns whether it was removed."""
        aside = self.root / f".tmp-{uuid.uuid4().hex}"
        try:
            os.rename(entry.path, aside)
        except FileNotFoundError:  # removed meanwhile (another prune)
            return False
        if unless_newer_than is not None and aside.stat().st_mtime > unless_newer_than and not entry.unfinished:
            try:
                os.rename(aside, entry.path)
                return False
            except OSError:  # put again meanwhile under its name: this copy is the spare
                pass
        shutil.rmtree(aside, ignore_errors=True)
        return True


@dataclass(frozen=True)
class StoreEntry:
    name: str  # the sha256, or `.tmp-...` for an unfinished write
    path: Path
    nbytes: int
    mtime: float  # when it was written (its folder's modification time)
    unfinished: bool


def _frame(name: str, size: int) -> bytes:
    return name.encode() + b"\n" + size.to_bytes(8, "big")


def _copy_hashing(src: Path, dst: Path | None, name: str, h: "hashlib._Hash") -> None:
    """Stream `src` into `dst` (if any) and the hash as file `name`, framed with the size it had when opened."""
    with open_regular(src) as f:
        size = os.fstat(f.fileno()).st_size
        h.update(_frame(name, size))
        out = open(dst, "wb") if dst is not None else None
        try:
            copied = 0
            while chunk := f.read(_CHUNK):
                copied += len(chunk)
                h.update(chunk)
                if out is not None:
                    out.write(chunk)
            if out is not None:
                out.flush()
                os.fsync(out.fileno())
        finally:
            if out is not None:
                out.close()
    if copied != size:
        raise AdapterError(f"{src} changed size while being read ({size} -> {copied} bytes); put it again once it is written", retriable=True)


def _check_config_json(data: bytes, path: Path) -> None:
    try:
        cfg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterError(f"{path} is not valid JSON ({e}); re-save the adapter with peft", code="adapter_corrupt") from e
    if not isinstance(cfg, dict):
        raise AdapterError(f"{path} must hold a JSON object, found {type(cfg).__name__}; re-save the adapter with peft", code="adapter_corrupt")


def _check_safetensors_header(path: Path, shown: Path) -> None:
    try:
        with safe_open(str(path), framework="pt") as f:
            f.keys()
    except SafetensorError as e:
        raise AdapterError(f"{shown} is not a readable safetensors file ({e}); re-save or re-download it", code="adapter_corrupt") from e


def _check_sha(sha: str) -> str:
    # Names come from callers (jobs, ledgers); only 64 hex digits may reach the filesystem, which also
    # confines every path to the store's root.
    if not isinstance(sha, str) or not _SHA_RE.match(sha):
        raise AdapterError(f"{sha!r} is not an adapter sha256 (64 lowercase hex digits)", code="adapter_missing")
    return sha
