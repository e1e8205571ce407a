"""The generated config reference (docs/config.md) is fresh."""

from __future__ import annotations

from enn_core import docs


def test_config_reference_is_fresh():
    assert docs.DOC.read_text() == docs.render(), (
        "docs/config.md is stale: run python -m enn_core.docs"
    )
