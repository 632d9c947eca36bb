"""A real headless Chromium for the tests of pages the project writes (the replay report).

`dump_dom` loads a page, lets its scripts run, and returns the DOM as the browser then holds it;
`screenshot` saves what it shows. `elements` parses a dumped DOM into the elements a test checks.
Chromium comes from Debian's `chromium` package (scripts/services.sh: ensure_chromium); where there is
none the tests skip, except under CI=true, where the test script installs it and a missing one fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import pytest

NAMES = ("chromium", "chromium-browser", "google-chrome", "chrome")
TIMEOUT_S = 120.0
"""One page load on a busy machine; Chromium normally answers in about a second."""


def find_chromium() -> str | None:
    """The browser to run: $ASYNCRL_CHROMIUM (a name on PATH or a path), else the first of NAMES on PATH."""
    override = os.environ.get("ASYNCRL_CHROMIUM")
    if override:
        return shutil.which(override)
    return next((path for path in map(shutil.which, NAMES) if path), None)


def require_chromium() -> str:
    """The browser, or skip the test saying why (fail under CI=true)."""
    found = find_chromium()
    if found is None:
        wanted = os.environ.get("ASYNCRL_CHROMIUM") or " / ".join(NAMES)
        reason = f"no headless Chromium here ({wanted} not found; apt-get install chromium)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI=true: scripts/test.sh is expected to provide it)")
        pytest.skip(reason)
    return found


def _run(url: str, *flags: str, budget_ms: int) -> subprocess.CompletedProcess:
    browser = require_chromium()
    with tempfile.TemporaryDirectory(prefix="asyncrl-chromium-") as profile:
        # --no-sandbox: Chromium's own sandbox refuses to start as root (containers, CI).
        command = [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
            "--disable-background-networking", f"--user-data-dir={profile}", f"--virtual-time-budget={budget_ms}", *flags, url,
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"chromium exited {done.returncode}: {done.stderr[-2000:]}")
    return done


def url_of(path: Path, fragment: str = "") -> str:
    return Path(path).resolve().as_uri() + (f"#{fragment}" if fragment else "")


def dump_dom(path: Path, fragment: str = "", *, budget_ms: int = 5000) -> str:
    """The page's DOM after its scripts ran (the `#fragment` is part of the URL it opens)."""
    return _run(url_of(path, fragment), "--dump-dom", budget_ms=budget_ms).stdout


def screenshot(path: Path, out: Path, fragment: str = "", *, size: tuple[int, int] = (1400, 1000), budget_ms: int = 5000) -> Path:
    """A PNG of the page's first `size` pixels."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    _run(url_of(path, fragment), f"--screenshot={out}", f"--window-size={size[0]},{size[1]}", "--hide-scrollbars", budget_ms=budget_ms)
    if not out.exists():
        raise RuntimeError(f"chromium wrote no screenshot at {out}")
    return out


@dataclass
class Element:
    tag: str
    attrs: dict[str, str]
    text: str = ""
    """All the text inside it, its children's included."""
    children: list[Element] = field(default_factory=list)

    @property
    def classes(self) -> set[str]:
        return set(self.attrs.get("class", "").split())


class _Collector(HTMLParser):
    VOID = frozenset({"meta", "input", "br", "img", "link", "hr"})

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.root = Element("#document", {})
        self.open: list[Element] = [self.root]
        self.all: list[Element] = []

    def handle_starttag(self, tag, attrs):
        element = Element(tag, {k: v or "" for k, v in attrs})
        self.open[-1].children.append(element)
        self.all.append(element)
        if tag not in self.VOID:
            self.open.append(element)

    def handle_endtag(self, tag):
        for i in range(len(self.open) - 1, 0, -1):
            if self.open[i].tag == tag:
                del self.open[i:]
                return

    def handle_data(self, data):
        for element in self.open[1:]:
            element.text += data


def parse(dom: str) -> list[Element]:
    """Every element of a serialized DOM, in document order."""
    collector = _Collector()
    collector.feed(dom)
    collector.close()
    return collector.all


def elements(dom: str, tag: str | None = None, cls: str | None = None) -> list[Element]:
    """The elements of `dom` with that tag and/or class."""
    return [e for e in parse(dom) if (tag is None or e.tag == tag) and (cls is None or cls in e.classes)]
