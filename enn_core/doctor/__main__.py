"""`python -m enn_core.doctor [--config params.yaml] [--set k=v] [--quick] [--json]
[--only data,model]`: the doctor without the CLI package (the same body `enn doctor` calls)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from enn_core.config import load_config
from enn_core.doctor import main
from enn_core.errors import EnnError
from enn_core.paths import Layout, find_root


def cli(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m enn_core.doctor", description=__doc__)
    p.add_argument(
        "--config", default=None, help="Config file (default: params.yaml in the project root)."
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument(
        "--quick", action="store_true", help="Skip the slow checks (torch.compile, torch.export)."
    )
    p.add_argument("--json", action="store_true", help="JSON for machines instead of the table.")
    p.add_argument("--only", default=None, help="Comma-separated layers, e.g. data,model.")
    args = p.parse_args(argv)
    config = Path(args.config).resolve() if args.config else find_root() / "params.yaml"
    try:
        cfg = load_config(config if config.exists() else None, args.overrides)
        layout = Layout.for_root(config.parent, cfg.runtime.work_dir)
        return main(cfg, layout, quick=args.quick, as_json=args.json, only=args.only)
    except EnnError as e:
        print(f"enn doctor: {e}", file=sys.stderr)
        return e.exit_code


if __name__ == "__main__":
    sys.exit(cli())
