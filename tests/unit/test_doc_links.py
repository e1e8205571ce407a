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
