"""Small files a command reads whole (a config, a manifest, a credential), read with a bound.

`--manifest /dev/zero` read for ever, growing its buffer until memory ran out, and a FIFO with no writer blocked the
command in its open. A file read whole must be a regular file (a device or a FIFO may never end) of at most `limit`
bytes; the error names the option or key that gave the path, the limit and the fix. The size is checked against the
bytes read too, not only the stat: a file that grows while it is read is cut off there.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

MIB = 1 << 20


class FileUnfit(ValueError):
    """The file is not a regular file, or is over its limit; the message says which, and the fix."""


def file_kind(mode: int) -> str:
    """What a file of this `st_mode` is, for an error: "FIFO (a named pipe)", "directory", ..."""
    if stat.S_ISFIFO(mode):
        return "FIFO (a named pipe)"
    if stat.S_ISCHR(mode):
        return "character device"
    if stat.S_ISBLK(mode):
        return "block device"
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISDIR(mode):
        return "directory"
    return "special file"


def shown_size(n: int) -> str:
    """`n` bytes as a limit is written: 64 MiB, 64 KiB, else a count of bytes."""
    if n >= MIB and n % MIB == 0:
        return f"{n // MIB} MiB"
    return f"{n // 1024} KiB" if n >= 1024 and n % 1024 == 0 else f"{n:,} bytes"


def open_regular(path: Path | str, *, what: str, fix: str) -> BinaryIO:
    """The regular file `path` opened for reading; FileUnfit (naming `what` and `fix`) for anything else, checked on the
    descriptor opened, not the path (engine.store `open_regular`). OSError for one that cannot be opened."""
    from engine.store import open_regular as opened

    def unfit(mode: int) -> FileUnfit:
        why = "" if stat.S_ISDIR(mode) else ": it is read whole, and reading it might never end"
        return FileUnfit(f"{what} {path} is a {file_kind(mode)}, not a regular file{why}; {fix}")

    return opened(path, unfit)


def read_bounded(path: Path | str, *, what: str, limit: int, fix: str) -> bytes:
    """The bytes of the regular file `path`, at most `limit` of them. `what` names where the path came from (`--manifest`,
    `kafka.sasl_password_file`), `fix` what to do instead. FileUnfit for a file that is no regular one or is too large;
    OSError for one that cannot be opened or read."""
    assert limit > 0, limit
    with open_regular(path, what=what, fix=fix) as f:
        st = os.fstat(f.fileno())
        data = f.read(limit + 1) if st.st_size <= limit else b""
        if st.st_size > limit or len(data) > limit:
            size = f"{shown_size(st.st_size)}" if st.st_size > limit else f"over {shown_size(limit)}"
            raise FileUnfit(f"{what} {path} is {size}, over the {shown_size(limit)} limit for it; {fix}")
    return data
