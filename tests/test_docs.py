"""The documentation, checked (STYLE.md, point 11): every relative link in README.md and
docs/*.md reaches a file, and the heading it names; every flag `appliance serve --help` lists
is explained in docs/serving.md; the README runs the test command CI runs; the front door and
the map stay short."""
from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

import pytest

from appliance.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
SERVING = ROOT / "docs" / "serving.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_LINES = {"README.md": 260, "docs/architecture.md": 420}

FENCE = re.compile(r"^\s*(```|~~~).*?^\s*\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+).+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)


def prose(text: str) -> str:
    """The text without its code blocks and code spans, where brackets are not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.replace("`", "").lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of `page` whose file, or heading, is not there (named from `root`)."""
    text = page.read_text()
    broken = []
    for target in links(text):
        if SCHEME.match(target):
            continue                      # http:, https:, mailto: are not files
        path, _, anchor = target.partition("#")
        dest = Path(os.path.normpath(page.parent / path)) if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(root) if dest.is_relative_to(root) else dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


def serve_flags() -> list[str]:
    """The long flags `appliance serve --help` lists, read from its options column."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    flags = []
    for line in out.getvalue().splitlines():
        if line.startswith("  -"):
            invocation = re.split(r"\s{2,}", line.strip())[0]
            flags += [f for f in re.findall(r"--[a-z][a-z0-9-]*", invocation) if f != "--help"]
    return flags


def named(flag: str, text: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


# -- the checkers themselves ------------------------------------------------------------------

def test_the_link_checker_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "there.md").write_text("# Will it fit? `appliance fit`\n\n## Tune once\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](there.md) [ok](there.md#will-it-fit-appliance-fit) [ok](https://x.org/a.md)\n"
                    "[gone](missing.md) [no heading](there.md#nowhere) `[code](not-a-link.md)`\n"
                    "```\n[fenced](not-a-link-either.md)\n```\n")
    assert broken_links(page, tmp_path) == ["missing.md: no file docs/missing.md",
                                            "there.md#nowhere: no heading #nowhere in there.md"]


def test_anchors_follow_github():
    assert anchors("# Serving: every flag of `appliance serve`\n## A, b\n## A, b\n") == {
        "serving-every-flag-of-appliance-serve", "a-b", "a-b-1"}


def test_serve_flags_are_read_from_help():
    flags = serve_flags()
    assert {"--model", "--n-ctx", "--no-flash-attn", "--log-level"} <= set(flags)
    assert len(flags) == len(set(flags)) > 40


# -- the documents ----------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_a_file_and_heading(page: Path):
    assert not broken_links(page), "\n".join(broken_links(page))


def test_the_readme_links_the_docs():
    targets = {t.partition("#")[0] for t in links(README.read_text())}
    missing = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in targets]
    assert not missing, f"README.md links none of: {', '.join(missing)}"


def test_every_serve_flag_is_in_serving_md():
    text = SERVING.read_text()
    missing = [f for f in serve_flags() if not named(f, text)]
    assert not missing, f"docs/serving.md does not name: {' '.join(missing)}"


def test_the_readme_gives_the_command_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert ci.startswith("python3 -m venv") and ci in README.read_text()


@pytest.mark.parametrize("name", sorted(MAX_LINES))
def test_the_front_door_and_the_map_stay_short(name: str):
    lines = len((ROOT / name).read_text().splitlines())
    assert lines <= MAX_LINES[name], f"{name} has {lines} lines (at most {MAX_LINES[name]})"
