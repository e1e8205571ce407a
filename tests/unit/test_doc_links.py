"""What README.md and docs/ show a reader holds: every relative link and anchor resolves, and
every `enn` command line in a code block parses (its subcommand and flags, as `enn ... --help`
would check them, without running anything)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.fixtures.project import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
SHELL = re.compile(r"^\s*```\s*(bash|sh|shell|console)\s*$")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    in_code = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if in_code or not m:
            continue
        text = re.sub(r"`([^`]*)`", r"\1", m.group(2))
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def prose(page: Path) -> str:
    """The page without its code blocks (a link inside code is an example, not a link)."""
    keep, in_code = [], False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            continue
        if not in_code:
            keep.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(keep)


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


def broken_links(page: Path) -> list[str]:
    bad = []
    for target in LINK.findall(prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{_name(page)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{_name(page)}: {target} (no heading #{anchor})")
    return bad


def enn_lines(page: Path) -> list[str]:
    """`enn ...` command lines inside shell code blocks (```bash, sh, shell, console: what a
    reader pastes; a picture's block is not one), continuation lines joined, comments cut."""
    out, in_code, in_shell, pending = [], False, False, ""
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            in_code = not in_code
            in_shell = in_code and bool(SHELL.match(line))
            pending = ""
            continue
        if not in_shell:
            continue
        text = pending + line.strip()
        if text.endswith("\\"):
            pending = text[:-1] + " "
            continue
        pending = ""
        for part in re.split(r"\s(?:&&|;|\|\|?)\s", text):
            part = part.strip().removeprefix("$ ")
            part = re.sub(r"^(?:[A-Z_][A-Z0-9_]*=\S*\s+)+", "", part)  # VAR=value enn ...
            part = re.sub(r"^(?:\.venv/bin/|\S*/bin/)(?=enn\s)", "", part)
            if re.match(r"^enn(\s|$)", part):
                out.append(" ".join(part.split(" #", 1)[0].split()))
    return out


def unparsable(command: str) -> str | None:
    """Why `command` would not parse, or None. Placeholders (<...>, $VAR, ...) are words."""
    from flows.parser import build_parser

    try:
        argv = shlex.split(command)[1:]
    except ValueError as e:
        return f"cannot be split as a shell line ({e})"
    argv = [a for a in argv if a not in ("...", "…")]
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        return None if e.code == 0 else "enn does not accept it"
    return None


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    assert not broken_links(page), "\n".join(broken_links(page))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_enn_command_in_a_code_block_parses(page, capsys):
    bad = [f"{c!r}: {why}" for c in enn_lines(page) if (why := unparsable(c))]
    capsys.readouterr()  # argparse's usage lines
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_are_for(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "# Getting started\n\n## Run `enn` twice\n\n[ok](#run-enn-twice) [gone](#nowhere) "
        "[file](missing.md) [web](https://example.org)\n\n```bash\nenn run --flow training\n"
        "enn run --flwo training\nenn validate \\\n  --set train.epochs=3\nenn nosuch\n```\n"
        "\n```\nenn picture -> not a command\n```\n"
    )
    assert anchors(page) == {"getting-started", "run-enn-twice"}
    assert [b.split(": ", 1)[1] for b in broken_links(page)] == [
        "#nowhere (no heading #nowhere)",
        "missing.md (no such file)",
    ]
    lines = enn_lines(page)
    assert lines[2] == "enn validate --set train.epochs=3"
    assert [unparsable(c) is None for c in lines] == [True, False, True, False]
    table = "| `a|b` | x \\| y | z |"
    assert table_cells(table) == ["`a|b`", "x | y", "z"]


# Issue 42: a README a newcomer reads, tables that fit a screen, every page reachable from the
# README, and help and errors that name the page a user looks at next.
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
README_LINES, TABLE_LINE, README_CELL = 250, 160, 120


def table_lines(page: Path) -> list[tuple[int, str]]:
    """Lines of markdown tables (starting with `|`) outside code blocks, numbered from 1."""
    out, in_code = [], False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            in_code = not in_code
        elif not in_code and line.startswith("|"):
            out.append((n, line))
    return out


def table_cells(line: str) -> list[str]:
    """The cells of one table line; a `|` inside a code span or escaped does not split."""
    cells, cur, code, i = [], "", False, 0
    body = line.strip().removeprefix("|").removesuffix("|")
    while i < len(body):
        ch = body[i]
        if body.startswith("\\|", i):
            cur, i = cur + "|", i + 2
            continue
        code = not code if ch == "`" else code
        if ch == "|" and not code:
            cells.append(cur.strip())
            cur = ""
        else:
            cur += ch
        i += 1
    return [*cells, cur.strip()]


def test_the_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_LINES, (
        f"README.md has {n} lines (at most {README_LINES}: move text to docs/)"
    )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_table_line_is_wider_than_a_screen(page):
    long = [f"line {n}: {len(t)} characters" for n, t in table_lines(page) if len(t) > TABLE_LINE]
    assert not long, f"{_name(page)} (at most {TABLE_LINE}; make long cells prose or a list):\n" + (
        "\n".join(long)
    )


def test_the_readmes_table_cells_are_one_line():
    long = [
        f"line {n}: {cell[:60]}... ({len(cell)} characters)"
        for n, line in table_lines(README)
        for cell in table_cells(line)
        if len(cell) > README_CELL
    ]
    assert not long, f"README.md cells over {README_CELL} characters:\n" + "\n".join(long)


def test_every_page_in_docs_is_linked_from_the_readme():
    linked = {
        (ROOT / t.partition("#")[0]).resolve()
        for t in LINK.findall(prose(README))
        if "://" not in t
    }
    missing = [_name(p) for p in DOCS if p.resolve() not in linked]
    assert not missing, f"pages README.md does not link: {missing}"


def test_every_page_opens_with_whom_it_is_for():
    """The first paragraph after a page's title says who it is for (generated config.md too)."""
    for page in DOCS:
        paragraphs = page.read_text().split("\n\n")[1:3]
        assert any(p.startswith("For ") for p in paragraphs), f"{_name(page)}: {paragraphs[0]!r}"


def test_help_ends_with_the_page_that_covers_the_command(capsys):
    from flows.cli import main
    from flows.parser import PAGES as HELP_PAGES
    from flows.parser import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert set(HELP_PAGES) == {"enn", *sub.choices}, "a command without its page in PAGES"
    for command, rel in HELP_PAGES.items():
        assert (ROOT / rel).is_file(), f"enn {command} --help names {rel}, which does not exist"
        with pytest.raises(SystemExit):
            main(["--help"] if command == "enn" else [command, "--help"])
        last = capsys.readouterr().out.strip().splitlines()[-1]
        assert rel in last, f"`enn {command} --help` ends with {last!r}, not {rel}"


def test_every_docs_page_the_product_code_names_exists():
    """Errors and docstrings point at pages ("see docs/security.md"); none names a page that is
    gone, and none still says "README, <section>" (the sections moved to docs/)."""
    named, stale = [], []
    for folder in ("enn_core", "tasks", "flows"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(ROOT)
            named += [(rel, m) for m in re.findall(r"docs/[\w.-]+\.md", text)]
            stale += [f"{rel}: {m}" for m in re.findall(r"README,[^)\"]*", text)]
    assert named, "no docs page named in the product code (the test reads the wrong tree)"
    missing = sorted({f"{rel}: {m}" for rel, m in named if not (ROOT / m).is_file()})
    assert not missing, "pages named in the code that do not exist:\n" + "\n".join(missing)
    assert not stale, "sections named in the README, which moved to docs/:\n" + "\n".join(stale)


def test_the_quick_start_is_what_ci_runs_and_the_tiers_page_matches_the_script():
    """The README's Quick start is the two commands; its second is what .ci/run runs; each tier
    docs/tests.md lists has scripts/test.sh's marker expression and budget."""
    block = re.search(r"## Quick start\n\n```bash\n(.*?)```", README.read_text(), re.S)
    assert block and block.group(1).splitlines() == ["bash scripts/demo.sh", "bash scripts/test.sh"]
    ci = [x for x in (ROOT / ".ci" / "run").read_text().splitlines() if x and x[0] != "#"]
    assert ci[-1] == "bash scripts/test.sh", ci
    script = (ROOT / "scripts" / "test.sh").read_text()
    tiers = {e: int(s) for s, e in re.findall(r'^tier \S+ (\d+) \d+ "([^"]+)"', script, re.M)}
    page = (ROOT / "docs" / "tests.md").read_text()
    shown = re.findall(r'selects: `-m "?([^"`]+)"?`.*?\n  - budget: (\d+) min', page, re.S)
    assert len(tiers) == 5 and {e: int(m) * 60 for e, m in shown} == tiers, (shown, tiers)
