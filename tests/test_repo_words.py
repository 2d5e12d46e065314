"""The repository's text speaks of the project, not of how its work was organised.

Every text file git knows (tracked, or untracked and not ignored) is searched for the words that
describe the work instead of the project: "session(s)" in that sense, "lent", "withheld", an issue
or helper by number ("issue 11", "helper 10"), "review mend", and the environment the work ran in
("no hub here", "our GPU machines", "not reachable where it was measured", "no 8-GPU machine",
"no time left"), also where a phrase runs across a line break. A failure lists ``file:line: text``.
README.md's recipe table holds one short figure a cell, each with its device and date.
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
    "our machines": re.compile(r"\bno hub here\b|\bour (?:GPU |CPU )?machines?\b|\bmachine was available\b"
                               r"|\bnot reachable (?:from (?:our|these|this) |where (?:it|this) )"
                               r"|\bno \d+-GPU (?:or [\w-]+ )?machine\b|\bno time left\b", re.IGNORECASE),
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
                "random weights (no hub here)", "not reachable from our GPU machines", "no 8-GPU machine was available",
                "(the hub is not reachable where it was measured)", "no 8-GPU or two-node machine was used",
                "the HF hub is not reachable from these machines", "(goal 10 s): no time left"):
        assert offending(bad), bad
    for fine in ('@pytest.fixture(scope="session")', "Popen(cmd, start_new_session=True)",
                 "a CLI run in a subprocess (own session)", "async with aiohttp.ClientSession() as s:",
                 "the issue's budget", "silently", "talent", "lentil", "excellent",
                 "data.train comes from the HF hub, which is not reachable: copy it", "one node of 8 GPUs"):
        assert not offending(fine), fine


def test_no_process_words_in_the_repository():
    hits = []
    for path in text_files():
        with open(os.path.join(ROOT, path), "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:
            continue  # binary (a plot, a wheel)
        lines = data.decode("utf-8", errors="replace").splitlines()
        for n, line in enumerate(lines, 1):
            if names := offending(line):
                hits.append(f"{path}:{n}: [{', '.join(names)}] {line.strip()[:160]}")
            elif n < len(lines) and (names := set(offending(f"{line.strip()} {lines[n].strip()}"))
                                     - set(offending(lines[n]))):  # a phrase across the line break
                hits.append(f"{path}:{n}-{n + 1}: [{', '.join(sorted(names))}] {line.strip()[-80:]} / "
                            f"{lines[n].strip()[:80]}")
    assert not hits, "words about how the work was organised, not about the project:\n" + "\n".join(hits)


# ---- README.md's recipe table ---------------------------------------------------------------------

CELL_CHARS = 48  # the longest cell a reader takes in at a glance (a figure, its device and date)
DATED = re.compile(r"^[\d.,]+(?: -> [\d.,]+)? s? ?\([^()]+, \d{4}-\d{2}-\d{2}\)$")  # 1.2 s (H100, 2026-11-25)


def recipe_table() -> tuple[list[str], list[list[str]]]:
    """README.md's table under ``## Recipes``: its header cells and its rows' cells (markdown links
    shown as their text), and a list of the link targets."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    section = text.split("\n## Recipes\n", 1)[1].split("\n## ", 1)[0]
    lines = [l for l in section.splitlines() if l.startswith("|")]
    cells = [[c.strip() for c in l.strip().strip("|").split("|")] for l in lines]
    return cells[0], cells[2:]


def test_the_readme_recipe_table_holds_one_figure_a_cell():
    """Every recipe has a row; a cell is at most CELL_CHARS characters as read (a link as its text); a
    step time or held-out score is a figure with its device and date, or "not run"; every report
    link names a file of the repository."""
    header, rows = recipe_table()
    assert header == ["recipe", "model, task", "hardware", "step time", "held-out pass@1", "report"], header
    recipes = sorted(d for d in os.listdir(os.path.join(ROOT, "recipes"))
                     if os.path.isfile(os.path.join(ROOT, "recipes", d, "config.yaml")))
    named = sorted(n for row in rows for n in re.findall(r"`(\w+)`", row[0]))
    assert named == recipes, (named, recipes)
    long, undated, missing = [], [], []
    for row in rows:
        assert len(row) == len(header), row
        for cell in row:
            shown = re.sub(r"\[([^\]]*)\]\(([^)]*)\)", r"\1", cell)
            if len(shown) > CELL_CHARS:
                long.append(f"{len(shown)}: {shown}")
            missing += [t for t in re.findall(r"\]\(([^)]*)\)", cell) if not os.path.isfile(os.path.join(ROOT, t))]
        undated += [c for c in row[3:5] if c != "not run" and not DATED.match(c)]
    assert not long, f"README.md recipe table: cells over {CELL_CHARS} characters (the details go in the " \
                     f"recipe's README):\n" + "\n".join(long)
    assert not undated, f"a figure with its device and date, e.g. '1.346 s (H100, 2026-11-25)': {undated}"
    assert not missing, missing
