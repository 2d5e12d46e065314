"""The repository's text speaks of the project, not of how its work was organised.

Every text file git knows (tracked, or untracked and not ignored) is searched for the words that
describe the work instead of the project: "session(s)" in that sense, "lent", "withheld", an issue
or helper by number ("issue 11", "helper 10") and "review mend". A failure lists ``file:line: text``.
Technical uses pass through the explicit allowlist below (a pytest fixture's ``scope="session"``, a
process session started with ``start_new_session``, HTTP client sessions, a ``--session`` flag).
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest

from helpers import ROOT

THIS = os.path.relpath(os.path.abspath(__file__), ROOT)

WORDS = {
    "session": re.compile(r"\bsessions?\b", re.IGNORECASE),
    "lent": re.compile(r"\blent\b", re.IGNORECASE),
    "withheld": re.compile(r"\bwithheld\b", re.IGNORECASE),
    "issue number": re.compile(r"\bissues?\s+(?:no\.?\s*)?#?\d+", re.IGNORECASE),
    "helper number": re.compile(r"\bhelpers?\s+#?\d+", re.IGNORECASE),
    "review mend": re.compile(r"\breview[\s-]+mends?\b", re.IGNORECASE),
    "our machines": re.compile(r"\bno hub here\b|\bour (?:GPU |CPU )?machines?\b|\bmachine was available\b",
                               re.IGNORECASE),
}

# Technical uses, removed from a line before it is searched.
ALLOWED = [
    re.compile(r"""scope\s*=\s*["']session["']"""),         # pytest fixture scope
    re.compile(r"\bstart_new_session\b"),                   # subprocess.Popen(start_new_session=True)
    re.compile(r"\(own session\)"),                         # ... a process in its own session (setsid)
    re.compile(r"\b(?:requests|aiohttp)\.\w*Session\b"),    # HTTP client sessions
    re.compile(r"\bClientSession\b"),
    re.compile(r"--session\b"),                             # a command-line flag of that name
]


def text_files() -> list[str]:
    """Repository-relative paths of the text files git knows, this file excepted."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    paths = sorted({p for p in out.decode().split("\0") if p})
    return [p for p in paths if p != THIS and os.path.isfile(os.path.join(ROOT, p))]


def offending(line: str) -> list[str]:
    """The names of the words in ``line`` (after the allowlist's phrases are taken out)."""
    for allowed in ALLOWED:
        line = allowed.sub(" ", line)
    return [name for name, rx in WORDS.items() if rx.search(line)]


def test_the_words_are_caught_and_the_technical_uses_pass():
    for bad in ("a fresh H100 (sixth session)", "no machine was lent", "the 4-GPU kinds were withheld",
                "the compaction (issue 11)", "found by helper 10", "(a review mend of b9a27a0)", "Sessions 2-3",
                "random weights (no hub here)", "not reachable from our GPU machines", "no 8-GPU machine was available"):
        assert offending(bad), bad
    for fine in ('@pytest.fixture(scope="session")', "Popen(cmd, start_new_session=True)",
                 "a CLI run in a subprocess (own session)", "async with aiohttp.ClientSession() as s:",
                 "the issue's budget", "silently", "talent", "lentil", "excellent"):
        assert not offending(fine), fine


def test_no_process_words_in_the_repository():
    hits = []
    for path in text_files():
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue  # binary (a plot, a wheel)
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if names := offending(line):
                hits.append(f"{path}:{n}: [{', '.join(names)}] {line.strip()[:160]}")
    assert not hits, "words about how the work was organised, not about the project:\n" + "\n".join(hits)
