"""Headless Chromium driven over the DevTools protocol, with no network and a record of every request.

tests/test_site_rendered.py loads each docs page in it. The browser is started with
``--remote-debugging-pipe``: the protocol's JSON messages, each ended by a NUL byte, go in on the
browser's file descriptor 3 and come out on 4, so no driver package and no port are needed, and the
protocol's Target, Page, Network and Runtime domains have kept their shape across Chromium versions
for years. Asserting on what the browser shows for a page it cannot fetch (an error page, an empty
``--dump-dom``) would tie the test to one version; the record of requests does not.

Nothing leaves the machine: host names other than 127.0.0.1 do not resolve and every other request
goes to a proxy address where nothing listens. The browser still *tries* such requests, and the
protocol reports each one (``Network.requestWillBeSent``) for the page and for every worker it
starts, which is what a test asserts on: the list of addresses a page asked for. Requests the
browser makes for itself (update checks, time sync) belong to no page and are not in that list.
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import queue
import subprocess
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

# No network: names other than 127.0.0.1 do not resolve, and anything else goes to a proxy where nothing listens.
OFFLINE_FLAGS = (
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
)


class BrowserError(RuntimeError):
    """The browser exited, did not answer in time, or answered a command with an error."""


@dataclass(slots=True)
class Page:
    """A page as the browser drew it: its DOM once ``ready`` held (or the time ran out), and what it asked for."""

    url: str
    dom: str
    ready: bool  # whether the readiness expression became true before the timeout
    requests: list[str] = field(default_factory=list)  # every URL the page or its workers requested, in order


class Browser:
    """One headless Chromium for many pages; use as a context manager so the process always ends."""

    def __init__(self, binary: str, profile: str, timeout: float = 30.0):
        self.timeout = timeout
        command_read, self._command_write = os.pipe()
        self._reply_read, reply_write = os.pipe()

        def onto_3_and_4():  # in the child: the pipes become the descriptors the protocol uses
            high = [fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in (command_read, reply_write)]
            os.dup2(high[0], 3)
            os.dup2(high[1], 4)

        self.process = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-dev-shm-usage",
             f"--user-data-dir={profile}", "--remote-debugging-pipe", *OFFLINE_FLAGS, "about:blank"],
            preexec_fn=onto_3_and_4, pass_fds=(3, 4), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        os.close(command_read)
        os.close(reply_write)
        self._inbox: queue.Queue[dict | None] = queue.Queue()
        self._last_id = 0
        self._events: list[dict] = []
        threading.Thread(target=self._read_replies, daemon=True).start()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        try:
            self._post("Browser.close")
        except OSError:  # the browser is already gone
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._command_write)

    def _read_replies(self) -> None:
        pending = b""
        with os.fdopen(self._reply_read, "rb", buffering=0) as replies:
            while chunk := replies.read(1 << 16):
                *messages, pending = (pending + chunk).split(b"\0")
                for message in messages:
                    self._inbox.put(json.loads(message))
        self._inbox.put(None)  # the browser closed its end: it exited

    def _post(self, method: str, params: dict | None = None, session: str | None = None) -> int:
        self._last_id += 1
        message = {"id": self._last_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._command_write, json.dumps(message).encode() + b"\0")
        return self._last_id

    def _receive(self, deadline: float) -> dict:
        """The next message; events are kept, and a worker the page starts is followed before it runs."""
        try:
            message = self._inbox.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            raise BrowserError("the browser did not answer in time") from None
        if message is None:
            stderr = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
            raise BrowserError(f"the browser exited (status {self.process.wait()}):\n{stderr[-3000:]}")
        if message.get("method") == "Target.attachedToTarget":  # a worker or frame, paused until we let it go
            child = message["params"]["sessionId"]
            self._post("Network.enable", session=child)
            self._post("Runtime.runIfWaitingForDebugger", session=child)
        if "method" in message:
            self._events.append(message)
        return message

    def send(self, method: str, params: dict | None = None, session: str | None = None) -> dict:
        """Run one protocol command and return its result."""
        sent = self._post(method, params, session)
        deadline = time.monotonic() + self.timeout
        while True:
            message = self._receive(deadline)
            if message.get("id") == sent:
                if "error" in message:
                    raise BrowserError(f"{method} failed: {message['error']}")
                return message["result"]

    def _drain(self) -> None:
        """Take every message already in (events the tab sent since the last command)."""
        while not self._inbox.empty():
            self._receive(time.monotonic() + 1)

    def _evaluate(self, expression: str, session: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True}, session)
        if "exceptionDetails" in result:
            raise BrowserError(f"{expression[:80]!r} raised: {result['exceptionDetails']}")
        return result["result"].get("value")

    def _loaded(self, session: str, loader: str) -> bool:
        """Whether the load event came after the navigation ``loader`` committed (not about:blank's, say)."""
        mine = [e for e in self._events if e.get("sessionId") == session]
        committed = next((i for i, e in enumerate(mine) if e["method"] == "Page.frameNavigated"
                          and e["params"]["frame"].get("loaderId") == loader), None)
        return committed is not None and any(e["method"] == "Page.loadEventFired" for e in mine[committed:])

    def render(self, url: str, ready: str = "true", timeout: float = 20.0) -> Page:
        """Load ``url`` in a new tab, wait for its load event and then for ``ready`` (a JS expression) to hold."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            self.send("Target.setAutoAttach", {"autoAttach": True, "waitForDebuggerOnStart": True, "flatten": True},
                      session)
            self.send("Network.enable", session=session)
            self.send("Page.enable", session=session)
            self._events.clear()
            loader = self.send("Page.navigate", {"url": url}, session)["loaderId"]
            deadline = time.monotonic() + timeout
            while not self._loaded(session, loader):
                self._receive(deadline)
            done = bool(self._evaluate(ready, session))
            while not done and time.monotonic() < deadline:
                time.sleep(0.1)
                done = bool(self._evaluate(ready, session))
            dom = self._evaluate("document.documentElement.outerHTML", session)
            sent = [e["params"]["request"]["url"] for e in self._events if e["method"] == "Network.requestWillBeSent"]
            return Page(url, dom, done, sent)
        finally:
            self.send("Target.closeTarget", {"targetId": target})

    @contextmanager
    def tab(self, url: str, ready: str, width: int = 1280, height: int = 800, timeout: float = 20.0):
        """A tab at a ``width`` x ``height`` viewport showing ``url`` once ``ready`` holds, to act on (``Tab``);
        closed on leaving the block. Its console errors and uncaught exceptions are collected."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        try:
            for domain in ("Page", "Runtime", "Network"):
                self.send(f"{domain}.enable", session=session)
            self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height,
                                                             "deviceScaleFactor": 1, "mobile": width < 600}, session)
            self._events.clear()
            loader = self.send("Page.navigate", {"url": url}, session)["loaderId"]
            deadline = time.monotonic() + timeout
            while not self._loaded(session, loader):
                self._receive(deadline)
            opened = Tab(self, session)
            opened.wait(ready, timeout=max(deadline - time.monotonic(), 1.0))
            yield opened
        finally:
            self.send("Target.closeTarget", {"targetId": target})


class Tab:
    """One open tab: evaluate expressions in it, wait for one to hold, take a screenshot, read its errors."""

    def __init__(self, browser: Browser, session: str) -> None:
        self.browser, self.session = browser, session

    def evaluate(self, expression: str):
        self.browser._drain()
        return self.browser._evaluate(expression, self.session)

    def wait(self, expression: str, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.evaluate(expression):
            if time.monotonic() > deadline:
                raise BrowserError(f"{expression[:80]!r} did not hold within {timeout} s")
            time.sleep(0.05)

    def choose_file(self, selector: str, path) -> None:
        """Set the file input at ``selector`` to ``path``, as a user choosing it would (its change event fires)."""
        self.browser.send("DOM.enable", session=self.session)
        root = self.browser.send("DOM.getDocument", {}, self.session)["root"]["nodeId"]
        node = self.browser.send("DOM.querySelector", {"nodeId": root, "selector": selector}, self.session)["nodeId"]
        self.browser.send("DOM.setFileInputFiles", {"files": [str(path)], "nodeId": node}, self.session)

    def screenshot(self, path) -> None:
        shot = self.browser.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True},
                                 self.session)
        with open(path, "wb") as out:
            out.write(base64.b64decode(shot["data"]))

    def errors(self) -> list[str]:
        """Console errors and uncaught exceptions of this tab so far."""
        self.browser._drain()
        found = []
        for event in self.browser._events:
            if event.get("sessionId") != self.session:
                continue
            if event["method"] == "Runtime.exceptionThrown":
                found.append(event["params"]["exceptionDetails"].get("text", "an exception"))
            elif event["method"] == "Runtime.consoleAPICalled" and event["params"]["type"] == "error":
                found.append(" ".join(str(a.get("value", a.get("description", ""))) for a in event["params"]["args"]))
        return found
