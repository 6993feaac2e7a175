"""Where log records go: JSON lines for a process that runs (`lorabatch worker`), plain warnings for commands.

A JSON line is one object: `ts` (UTC, ISO 8601, milliseconds), `level`, `logger`, `msg` (the message with its
arguments filled in), the record's `extra` fields, and `exc` / `stack` (the traceback as one string) when the
record carries them. Every line parses with `json.loads`, whatever the message holds (quotes, newlines, lone
surrogates, objects that are not JSON): text is escaped to ASCII and other values are written as their `str`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime

# Attributes every LogRecord has; anything else on a record came from `extra=` and is written as a field.
_STANDARD = frozenset(vars(logging.LogRecord("x", logging.INFO, "x", 0, "x", None, None))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        try:
            msg = record.getMessage()
        except Exception as e:  # a bad format string or arguments must not lose the record
            msg = f"{record.msg!s} (unformattable with args {record.args!r}: {type(e).__name__}: {e})"
        line: dict = {"ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                      "level": record.levelname, "logger": record.name, "msg": msg}
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                line[key if key not in line else f"extra_{key}"] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            line["exc"] = record.exc_text
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=True)  # ASCII: a lone surrogate cannot break the stream


# Top-level logger names of lorabatch's own records: `lorabatch.*`, and modules that log under `__name__`.
_OUR_LOGGERS = frozenset({"lorabatch", "consumer", "engine", "billing", "kernels", "migrations"})


class _LibrariesFromWarning(logging.Filter):
    """Lorabatch's records at the handler's level; a library's from WARNING (alembic logs seven INFO lines of plugin
    setup at every schema check)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.name.partition(".")[0] in _OUR_LOGGERS


class LibraryRepeats(logging.Filter):
    """A library's record that repeats, at most once every `every_s` per logger and message (its format string's first
    line), the next one written counting those left out. With the broker dead, aiokafka logs each retry of each of
    its connections at ERROR: a worker wrote 8,871 of its lines in 80 s, its own few lines lost among them.
    Lorabatch's records pass untouched (they are summarised where they repeat: `Outage`, `Repeats`)."""

    MAX_KEYS = 1024  # messages whose repeats are tracked; past it the oldest are forgotten (a library's are a few dozen)

    def __init__(self, every_s: float = 30.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.every_s = every_s
        self._clock = clock
        self._seen: dict[tuple[str, str], tuple[float, int]] = {}  # (logger, message) -> (written at, left out since)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name.partition(".")[0] in _OUR_LOGGERS:
            return True
        key = (record.name, str(record.msg).partition("\n")[0])
        now = self._clock()
        written, left_out = self._seen.get(key, (-float("inf"), 0))
        if now - written < self.every_s:
            self._seen[key] = (written, left_out + 1)
            return False
        self._seen.pop(key, None)
        if len(self._seen) >= self.MAX_KEYS:
            del self._seen[next(iter(self._seen))]
        self._seen[key] = (now, 0)
        if left_out:
            record.left_out = left_out  # a field of its JSON line: how many like it were not written since the last
        return True


def json_logging(level: str = "INFO", stream=None) -> None:
    """Every record at `level` and above as a JSON line on `stream` (stderr); libraries' own chatter from WARNING, and
    their repeats once every 30 s (`LibraryRepeats`)."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(_LibrariesFromWarning())
    handler.addFilter(LibraryRepeats())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.captureWarnings(True)  # a library's `warnings.warn` becomes a JSON line too, not raw text
    logging.getLogger("aiokafka").setLevel(logging.WARNING)  # its INFO is a line per connection


def json_active() -> bool:
    """Whether records go out as JSON lines (then an error that ends the process is one too)."""
    return any(isinstance(h.formatter, JsonFormatter) for h in logging.getLogger().handlers)


class _Ours(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name == "lorabatch" or record.name.startswith("lorabatch.")


class _Plain(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return f"{record.levelname.lower()}: {' '.join(record.getMessage().split())}"


def command_logging(debug: bool = False) -> None:
    """For the short-lived commands: lorabatch's warnings as `warning: ...` lines on stderr, libraries' left out
    (a broker that is down is the command's one error line, not a library's retry log); with `debug`, every
    logger from DEBUG, with its name. Handlers someone else set up first (a test's, say) are left alone."""
    root = logging.getLogger()
    ours = [h for h in root.handlers if getattr(h, "_lorabatch_command", False)]
    if root.handlers and not ours:
        return
    for h in ours:
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._lorabatch_command = True  # type: ignore[attr-defined]
    if debug:
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    else:
        handler.setFormatter(_Plain())
        handler.addFilter(_Ours())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.WARNING)


class Throttle:
    """At most one log line every `every_s` about a condition that repeats (a dependency away): `due()` says whether
    this one may be written, and if so starts the next interval."""

    def __init__(self, every_s: float, clock: Callable[[], float] = time.monotonic):
        self.every_s = every_s
        self._clock = clock
        self._last = -float("inf")

    def due(self) -> bool:
        now = self._clock()
        if now - self._last < self.every_s:
            return False
        self._last = now
        return True


class Outage:
    """A dependency's failures as one streak in the log: the first with its traceback, then a line every `every_s`
    while they go on, and one when it works again (not a traceback at every try)."""

    def __init__(self, what: str, logger: logging.Logger, consequence: str, every_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):  # fmt: skip
        self.what, self.log, self.consequence = what, logger, consequence
        self._clock = clock
        self._throttle = Throttle(every_s, clock)
        self.since: float | None = None  # when the streak began (the clock's time); None while it works

    def failed(self, e: BaseException) -> None:
        now = self._clock()
        if self.since is None:
            self.since = now
            self._throttle.due()
            self.log.error("%s failed; %s", self.what, self.consequence, exc_info=e)
        elif self._throttle.due():
            first = str(e).splitlines()[0][:200] if str(e) else ""
            self.log.warning("%s still failing after %.0f s (%s: %s); %s", self.what, now - self.since, type(e).__name__,
                             first, self.consequence)

    def ok(self) -> None:
        if self.since is not None:
            self.log.warning("%s works again after %.0f s", self.what, self._clock() - self.since)
            self.since = None



class Repeats:
    """A line per event that producers repeat at will (a DLQ record per bad message): the first of a quiet spell is
    written as it comes; the rest are counted by kind (a closed set, such as error codes) and written as one line at most
    every `every_s`, with the counts and the last one's own line. A flood of 3,000 bad messages wrote 3,000 lines in a
    second, each a copy of what its DLQ record holds; now it writes two. `flush` writes what is counted once it is due
    (the worker calls it as it loops, so the count of a burst comes out even when nothing follows it)."""

    def __init__(self, what: str, logger: logging.Logger, every_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        self.what, self.log, self.every_s = what, logger, every_s
        self._clock = clock
        self._written_at = -float("inf")  # when the last line went out
        self._counts: Counter[str] = Counter()
        self._last = ""

    def note(self, kind: str, line: str) -> None:
        now = self._clock()
        if not self._counts and now - self._written_at >= self.every_s:
            self.log.warning("%s", line)
            self._written_at = now
            return
        self._counts[kind] += 1
        self._last = line
        self.flush()

    def flush(self, *, force: bool = False) -> None:
        """Write the count of what was noted since the last line, once `every_s` has passed since it (at once: `force`)."""
        now = self._clock()
        if not self._counts or (now - self._written_at < self.every_s and not force):
            return
        kinds = ", ".join(f"{kind} {n}" for kind, n in sorted(self._counts.items(), key=lambda kv: (-kv[1], kv[0])))
        self.log.warning("%d more %s in the last %.0f s (%s); the last: %s", self._counts.total(), self.what,
                         now - self._written_at, kinds, self._last)
        self._counts.clear()
        self._written_at = now
