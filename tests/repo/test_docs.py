"""The documentation stays true to the repository: generated figures, links, size, self-containment.

Torch-free and fast: these tests read files only.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

DOCS = REPO / "docs"

#: Markdown files whose relative links must resolve.
LINKED_PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]

#: The sections that code docstrings cite as `docs/design.md`, section "…".
DESIGN_SECTIONS = ("Data flow", "File formats", "Statistical rules", "Gate signals")

# Patterns are assembled so that this file does not match them itself.
_OLD_DESIGN = re.compile(r"(?<!docs/)" + "DESIGN" + r"\.md")
_OUTSIDE = re.compile(r"\.\./shared|/work/" + "shared" + r"|\.\./\.\./")


def _benchmarks_doc():
    spec = importlib.util.spec_from_file_location("benchmarks_doc", REPO / "tools" / "benchmarks_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_benchmarks_page_is_exactly_what_the_results_generate():
    generated = _benchmarks_doc().render()
    committed = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert committed == generated, (
        "docs/benchmarks.md differs from benchmarks/results/*.json; run `python tools/benchmarks_doc.py`"
    )


def test_readme_figures_are_exactly_what_the_results_generate():
    doc = _benchmarks_doc()
    committed = (REPO / "README.md").read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- generated: (\S+) \(", committed)
    assert sorted(blocks) == sorted(doc.README_BLOCKS), (
        f"README.md's generated blocks are {blocks}, tools/benchmarks_doc.py renders {sorted(doc.README_BLOCKS)}"
    )
    assert committed == doc.render_readme(committed), (
        "README.md's generated figures differ from benchmarks/results/*.json; run `python tools/benchmarks_doc.py`"
    )


def test_every_results_file_has_its_own_section():
    doc = _benchmarks_doc()
    names = {p.stem for p in (REPO / "benchmarks" / "results").glob("*.json")}
    missing = sorted(names - set(doc.SECTIONS))
    assert not missing, f"results without a written section in tools/benchmarks_doc.py: {missing}"


def test_embedded_model_page_shows_the_measured_accuracy():
    doc = _benchmarks_doc()
    data = json.loads((REPO / "benchmarks" / "results" / "embedded_accuracy.json").read_text(encoding="utf-8"))
    page = (DOCS / "embedded-model.md").read_text(encoding="utf-8")
    assert doc.accuracy_table(data) in page, (
        "docs/embedded-model.md's accuracy table differs from benchmarks/results/embedded_accuracy.json; "
        "paste tools/benchmarks_doc.py's accuracy table"
    )


def test_readme_is_at_most_200_lines():
    lines = (REPO / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/"


def test_readme_shows_the_two_commands_verbatim():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "pip install torch==2.13.0 -e . && certkv demo" in readme
    ci_command = re.search(r"^TEST_CMD='(.+)'$", (REPO / ".ci" / "run").read_text(encoding="utf-8"), flags=re.M)
    assert ci_command, ".ci/run no longer names its test command as TEST_CMD='...'"
    assert ci_command.group(1) in readme
    assert ci_command.group(1).startswith('pip install torch==2.13.0 -e ".[test,ray]"')


def test_design_page_has_the_sections_code_points_to():
    headings = re.findall(r"^#+ (.+?)\s*$", (DOCS / "design.md").read_text(encoding="utf-8"), flags=re.M)
    missing = [s for s in DESIGN_SECTIONS if s not in headings]
    assert not missing, f"docs/design.md lacks the sections {missing}"


def test_citations_of_the_design_page_name_its_sections():
    headings = set(re.findall(r"^#+ (.+?)\s*$", (DOCS / "design.md").read_text(encoding="utf-8"), flags=re.M))
    cited = re.compile(r"docs/design\.md[\s,(]*(?:section\s+)?\"([^\"]+)\"")
    unknown = [
        f"{path.relative_to(REPO)}: {name!r}"
        for path in _repository_text_files()
        for name in cited.findall(path.read_text(encoding="utf-8"))
        if name not in headings
    ]
    assert not unknown, f"citations of docs/design.md sections that do not exist: {unknown}"


def _repository_text_files() -> list[Path]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=REPO, capture_output=True, check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = []
    for name in sorted(set(out.decode("utf-8").split("\0")) - {""}):
        path = REPO / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        files.append(path)
    return files


def test_nothing_points_to_the_old_design_file_or_outside_the_repository():
    offenders = []
    for path in _repository_text_files():
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if _OLD_DESIGN.search(line) or _OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{lineno}: {line.strip()[:100]}")
    assert not offenders, (
        "files name the old design file (cite docs/design.md and its section instead) or point outside "
        "the repository:\n" + "\n".join(offenders)
    )


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _links(text: str) -> list[str]:
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)  # code blocks
    text = re.sub(r"`[^`\n]*`", "", text)  # inline code
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text)


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(page):
    broken = []
    for target in _links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        path = (page.parent / file_part).resolve() if file_part else page
        if REPO not in path.parents and path != REPO:
            broken.append(f"{target} (outside the repository)")
            continue
        if not path.exists():
            broken.append(f"{target} (no such file)")
            continue
        if anchor and path.suffix == ".md":
            anchors = {_slug(h) for h in re.findall(r"^#+ (.+?)\s*$", path.read_text(encoding="utf-8"), flags=re.M)}
            if anchor not in anchors:
                broken.append(f"{target} (no heading #{anchor})")
    assert not broken, f"{page.relative_to(REPO)}: broken links: {broken}"
