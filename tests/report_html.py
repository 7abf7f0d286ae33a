"""Checks of an HTML report: its network references, and how headless Chromium renders it."""
from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

NETWORK = re.compile(r"^\s*(?:[a-z][a-z0-9+.-]*:)?//", re.I)  # http://, https://, //host, ftp://
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")
                 if shutil.which(n)), None)


class _Refs(HTMLParser):
    """Every attribute that makes a browser fetch or navigate (src, href, srcset, data,
    action, poster), and url(...) in style attributes; script bodies are text, not tags."""

    def __init__(self):
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag, attrs):
        for name, value in attrs:
            if name in ("src", "href", "srcset", "data", "action", "poster") and value:
                self.refs.append(value)
            if name == "style" and value:
                self.refs += re.findall(r"url\(\s*['\"]?([^'\")]+)", value)


def network_references(html: str) -> list[str]:
    """The references of `html` that would go to the network (empty: it opens offline)."""
    parser = _Refs()
    parser.feed(html)
    return [ref for ref in parser.refs if NETWORK.match(ref)]


def render(path: Path, profile: Path, timeout: float = 90.0) -> tuple[str, str]:
    """(the DOM after its scripts ran, Chromium's log) of a local file, network off."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           "--no-first-run", "--host-resolver-rules=MAP * ~NOTFOUND",  # nothing resolves
           f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
           "--virtual-time-budget=5000", "--dump-dom", path.resolve().as_uri()]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return done.stdout, done.stderr


def console_errors(log: str) -> list[str]:
    """Script errors and failed loads Chromium logged for the page."""
    return [line for line in log.splitlines() if ":CONSOLE" in line
            and re.search(r"Uncaught|Error|Failed to load", line)]
