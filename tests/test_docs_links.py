"""The documents the project owns stand on their own: every relative link in the README and docs/ leads to a file
of the repository (and, with an ``#anchor``, to a heading of it), and no code or document refers to files the
repository does not have. Fast: reads files only."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
# Where the project's own code and documents live (examples/ holds third-party bundles, copied unmodified).
OWNED = ("mn_prefect", "docs", "flows", "blocks", "deployments", "benchmarks", "tests")
OWNED_FILES = ("README.md",)
TEXT_SUFFIXES = {".py", ".md", ".json", ".yaml", ".yml", ".toml", ".txt", ".html", ".js", ".css", ".sql", ".env",
                 ".service", ".sh", ".cfg", ".ini", ""}

_FENCE = re.compile(r"^(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target), the target up to whitespace or ')' (an optional "title" may follow).
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)  # http:, https:, mailto:...

# Files that are not in the repository, and must not be named as if they were. Built from pieces so that this
# file does not name them itself.
_MD = "." + "md"
GONE = [re.escape(name + _MD) for name in ("SPEC", "BUNDLES", "DESIGN", "STYLE")]
GONE += [re.escape("checks/" + name + ".py") for name in ("bundle_contract", "plan_contract")]
GONE += [re.escape(".." + "/shared"), r"\bseeds/", r'"shared"\s*/\s*"checks"']
# Section references to a specification that is not in the repository (a section number after its name).
GONE += [r"\bSPEC" + r"\s+(?:section|sections|order|\d)", r"\bBUNDLES" + r"\s+\d"]
GONE_PATTERN = re.compile("|".join(GONE))


def prose_lines(text: str, *, keep_code: bool = False) -> list[tuple[int, str]]:
    """The lines of a Markdown text outside fenced code blocks, numbered from 1, inline code removed unless
    ``keep_code``."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line if keep_code else _INLINE_CODE.sub("", line)))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_`` kept), spaces to ``-``."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = text.replace("`", "").strip().lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub makes for ``path``'s headings (a repeated heading gets ``-1``, ``-2``...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(path.read_text(encoding="utf-8"), keep_code=True):
        match = _HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[tuple[int, str]]:
    return [(number, m.group(1)) for number, line in prose_lines(path.read_text(encoding="utf-8"))
            for m in _LINK.finditer(line)]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    """Why each relative link of the Markdown file ``path`` (in the repository at ``root``) leads nowhere."""
    problems = []
    for number, target in links(path):
        if _EXTERNAL.match(target):
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path.resolve()
        where = f"{path.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif not dest.is_relative_to(root):
            problems.append(f"{where}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"{where}: no heading with anchor #{anchor} in {dest.relative_to(root)}")
    return problems


def owned_files() -> list[Path]:
    files = [ROOT / name for name in OWNED_FILES]
    for folder in OWNED:
        files += [p for p in (ROOT / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES
                  and "__pycache__" not in p.parts]
    return sorted(files)


def test_the_documents_exist():
    assert (ROOT / "README.md") in DOCUMENTS and len(DOCUMENTS) > 5


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file_and_heading_of_the_repository(path):
    assert broken_links(path) == []


def test_a_broken_link_is_found(tmp_path):
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    (tmp_path / "docs" / "other.md").write_text("# Other page\n\n## A section: with `code`\n")
    doc.write_text("# Page\n\n[ok](other.md#a-section-with-code) [self](#page) ![img](../missing.png)\n"
                   "[gone](nowhere.md) [bad anchor](other.md#no-such) [web](https://example.com/x.md)\n"
                   "```\n[in code](not-checked.md)\n```\n")
    problems = broken_links(doc, tmp_path.resolve())
    assert [p.split(": ", 1)[1] for p in problems] == [
        "../missing.png: no such file", "nowhere.md: no such file",
        "other.md#no-such: no heading with anchor #no-such in docs/other.md"]


def test_anchors_follow_github():
    assert slug("Node lifecycle: states, reconcile after node loss, maintenance, drain") == \
        "node-lifecycle-states-reconcile-after-node-loss-maintenance-drain"
    assert slug("Quick start (fresh machine: Python 3.11, pip)") == "quick-start-fresh-machine-python-311-pip"
    assert slug("Runtime drivers: host_local against docker (issue 4/7)") == \
        "runtime-drivers-host_local-against-docker-issue-47"


def test_no_owned_file_refers_to_files_the_repository_does_not_have():
    found = []
    for path in owned_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if GONE_PATTERN.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert found == []


def test_the_pattern_catches_what_it_must():
    for text in ("see " + "SPEC" + _MD, "BUNDLES" + _MD + " 2.3", "DESIGN" + _MD, "STYLE" + _MD,
                 "checks/" + "bundle_contract.py", ".." + "/shared/checks", "SPEC" + " section 7", "BUNDLES" + " 3.3",
                 'parents[2] / "shared"' + ' / "checks"'):
        assert GONE_PATTERN.search(text), text
    for text in ("BUNDLES = ROOT / 'examples'", "tests/contract/bundle_contract.py", "docs/resources.md"):
        assert not GONE_PATTERN.search(text), text
