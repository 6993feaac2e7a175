"""Open a page in headless Chromium over the DevTools protocol (a pipe) and report what went wrong on it.

`page_problems(path)` loads a file and returns a list of problems: console errors and assertions,
uncaught exceptions, errors the browser logged (a resource that failed to load), and images that did
not decode (complete with naturalWidth 0). An empty list means the page rendered cleanly.

Chromium speaks the protocol on fds 3 (it reads) and 4 (it writes) with --remote-debugging-pipe: one
JSON message per NUL-terminated frame.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"


class _Pipe:
    def __init__(self, to_browser: int, from_browser: int):
        self._out, self._in = to_browser, from_browser
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict[str, Any]] = []

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None, timeout: float = 30) -> dict[str, Any]:
        self._next_id += 1
        message: dict[str, Any] = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._out, json.dumps(message).encode() + b"\0")
        while True:
            reply = self.receive(timeout)
            if reply.get("id") == self._next_id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply.get("result", {})
            self.events.append(reply)

    def receive(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self._in], [], [], max(left, 0))
            assert ready, "Chromium did not answer within the timeout"
            chunk = os.read(self._in, 1 << 20)
            assert chunk, "Chromium closed the DevTools pipe"
            self._buffer += chunk
        frame, _, self._buffer = self._buffer.partition(b"\0")
        return json.loads(frame)

    def wait_for(self, method: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while not any(e.get("method") == method for e in self.events):
            self.events.append(self.receive(deadline - time.monotonic()))


def page_problems(path: Path, timeout: float = 60) -> list[str]:
    """Problems seen while Chromium loads `path` (empty: none)."""
    to_browser_r, to_browser_w = os.pipe()
    from_browser_r, from_browser_w = os.pipe()

    def child_fds() -> None:
        # Through fresh copies first: a pipe end may already be fd 3 or 4, and dup2 onto itself would
        # neither move the other end out of the way nor clear close-on-exec.
        reader, writer = os.dup(to_browser_r), os.dup(from_browser_w)
        os.dup2(reader, 3)
        os.dup2(writer, 4)

    with tempfile.TemporaryDirectory() as profile:
        browser = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", "--no-first-run", "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--remote-debugging-pipe", "about:blank"],
            preexec_fn=child_fds, close_fds=False, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        os.close(to_browser_r)
        os.close(from_browser_w)
        pipe = _Pipe(to_browser_w, from_browser_r)
        try:
            target = pipe.send("Target.createTarget", {"url": "about:blank"}, timeout=timeout)["targetId"]
            session = pipe.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
            for domain in ("Runtime", "Log", "Page"):
                pipe.send(f"{domain}.enable", session=session)
            pipe.send("Page.navigate", {"url": path.resolve().as_uri()}, session=session)
            pipe.wait_for("Page.loadEventFired", timeout)
            images = pipe.send("Runtime.evaluate", {
                "expression": "JSON.stringify([...document.images].map(i => [i.alt, i.complete, i.naturalWidth]))", "returnByValue": True,
            }, session=session)["result"]["value"]
            time.sleep(0.2)  # let messages logged during the last layout arrive
            pipe.send("Runtime.evaluate", {"expression": "1"}, session=session)
            try:
                pipe.send("Browser.close", timeout=5)
            except AssertionError:
                pass  # it may close the pipe before answering
        finally:
            os.close(to_browser_w)
            os.close(from_browser_r)
            try:
                browser.wait(15)
            except subprocess.TimeoutExpired:
                browser.kill()
                browser.wait()
    problems = []
    for event in pipe.events:
        method, params = event.get("method"), event.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            problems.append(f"console.{params['type']}: {[a.get('value', a.get('description')) for a in params.get('args', [])]}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            problems.append(f"uncaught exception: {details.get('exception', {}).get('description') or details.get('text')}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            problems.append(f"browser error: {params['entry'].get('text')} {params['entry'].get('url', '')}")
    for alt, complete, width in json.loads(images):
        if not complete or width == 0:
            problems.append(f"image {alt!r} did not load")
    if not json.loads(images):
        problems.append("the page has no image")
    return problems
