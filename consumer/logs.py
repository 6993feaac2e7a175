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


def json_logging(level: str = "INFO", stream=None) -> None:
    """Every record at `level` and above as a JSON line on `stream` (stderr); libraries' own chatter from WARNING."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter())
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
