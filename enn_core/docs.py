"""Generate the config reference (docs/config.md) from the config dataclasses and the stage
registry (which sections each stage reads).

python -m enn_core.docs            # rewrite docs/config.md
python -m enn_core.docs --check    # exit 1 when docs/config.md is stale (a test runs this)
"""

from __future__ import annotations

import dataclasses
import json
import sys
import typing
from pathlib import Path

from enn_core.config import RunConfig
from enn_core.config.fields import field_help
from enn_core.stages import TRAINING

if typing.TYPE_CHECKING:
    from _typeshed import DataclassInstance

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"


def _type_name(tp: object) -> str:
    s = str(tp).replace("typing.", "")
    return getattr(tp, "__name__", s) if isinstance(tp, type) else s


def _rows(cls: type[DataclassInstance], prefix: str) -> list[str]:
    rows = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            rows.extend(_rows(tp, key + "."))
            continue
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = f.default
        shown = json.dumps(
            list(default) if isinstance(default, tuple) else default, ensure_ascii=False
        )
        help_ = field_help(cls).get(f.name, "")
        rows.append(f"- `{key}` (`{_type_name(tp)}`, default `{shown}`): {help_}")
    return rows


def render() -> str:
    out = [
        "# Config reference",
        "",
        "Generated from the dataclasses in `enn_core/config/` by `python -m enn_core.docs`;",
        "a test fails when this file is stale. "
        "Merge order: defaults -> `params.yaml` -> `--set key=value`.",
        "",
        "For anyone changing a value: every key of `params.yaml` (and of a `--config` file), its",
        "type, its default and what it means; how to set one is in docs/getting-started.md.",
        "",
        "## Which sections each stage reads",
        "",
        "| stage | params sections | enn_core code it runs |",
        "| --- | --- | --- |",
    ]
    out += [
        f"| `{s.name}` | {', '.join(f'`{x}`' for x in s.sections)} | "
        f"{', '.join(f'`{c}`' for c in s.code)} |"
        for s in TRAINING
    ]
    out += [
        "",
        "`runtime` (workers, devices, timeouts), `tracking` and `fault` are read by every stage's",
        "runner but change no result, so no stage depends on them (changing the world size does",
        "not re-train). `dvc.yaml` lists the same sections under each stage's `params:` (a test",
        "keeps the two equal).",
    ]
    hints = typing.get_type_hints(RunConfig)
    for f in dataclasses.fields(RunConfig):
        out += [
            "",
            f"## `{f.name}`",
            "",
            field_help(RunConfig).get(f.name, ""),
            "",
        ]
        out += _rows(hints[f.name], f.name + ".")
    return "\n".join(out) + "\n"


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not DOC.exists() or DOC.read_text() != text:
            print(f"{DOC} is stale; run: python -m enn_core.docs", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(text)
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
