"""The model code a run may import (no torch here: the task layer checks it before a stage).

- `ModelCode`: the `model.factory` of the params in use and the project root it is imported
  from; a checkpoint naming another factory is refused (a checkpoint never chooses what code
  runs). `BUILTIN` allows the built-in presets only.
- `module_file`: the factory's module file, found by path without importing it; it and every
  package on the way must resolve inside the project (`check_inside`: a link that leads out
  is refused before anything is imported).
- `check_dvc_deps`: that module is a dependency of the stages that build the model in
  `dvc.yaml`, so that editing it re-runs training.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from enn_core.config.model import ModelConfig
from enn_core.errors import ConfigError, StaleOutputError


@dataclass(frozen=True)
class ModelCode:
    """The model code the params in use allow: their `model.factory` and the project root it
    is imported from. The default allows only the built-in presets."""

    factory: str = ""
    root: str = "."

    @classmethod
    def of(cls, cfg: ModelConfig, root: str | Path = ".") -> ModelCode:
        return cls(cfg.factory, str(root))

    def allow(self, factory: str, where: str) -> None:
        """Refuse a checkpoint built by a factory other than the one the params name."""
        if factory and factory != self.factory:
            here = f"model.factory is {self.factory!r}" if self.factory else "none is named"
            raise StaleOutputError(
                f"{where} was built by model.factory {factory!r}, but {here} in the params in "
                "use; a checkpoint never chooses what code runs: if you trust that code, name "
                f"it (--set model.factory={factory}, or in the params file)"
            )


BUILTIN = ModelCode()


def code_root(factory: str, root: str | Path) -> Path:
    """Where the factory's module is importable from: the pipeline's directory, or the nearest
    directory above it that holds the module's path (prediction/ runs the repository's code),
    up to the repository (the first directory holding .git)."""
    parts = factory.split(":", 1)[0].split(".")
    here = Path(root).resolve()
    for d in (here, *here.parents):
        base = d.joinpath(*parts)
        if base.with_suffix(".py").is_file() or (base / "__init__.py").is_file():
            return d
        if (d / ".git").exists():
            break
    raise ConfigError(
        f"model.factory={factory!r}: no {Path(*parts)}.py under the project root {here} (or "
        "the repository above it); the factory's module must be importable from the root"
    )


def module_file(factory: str, root: str | Path) -> Path:
    """The file of the factory's module (`a.b:c` -> a/b.py or a/b/__init__.py), found by path
    without importing anything; refused when it, or a package on the way, is a link that
    leads out of the project (`check_inside`)."""
    parts = factory.split(":", 1)[0].split(".")
    top = code_root(factory, root)
    check_inside(factory, top)
    base = top.joinpath(*parts)
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"


def check_inside(factory: str, top: Path) -> None:
    """Every folder and file importing the factory's module walks (`a/`, `a/__init__.py`,
    `a/b.py`) resolves inside `top`, links followed: code reached through a link that leaves the
    project would run while dvc.yaml tracks only the link."""
    parts = factory.split(":", 1)[0].split(".")
    inside = top.resolve()
    for i in range(1, len(parts) + 1):
        base = top.joinpath(*parts[:i])
        for p in (base, base.with_suffix(".py"), base / "__init__.py"):
            if (p.is_symlink() or p.exists()) and not p.resolve().is_relative_to(inside):
                raise ConfigError(
                    f"model.factory={factory!r}: {p} leads outside the project, to "
                    f"{p.resolve()}; the factory's code must lie in the project (where dvc.yaml "
                    "tracks it): copy it in instead of linking it"
                )


def check_dvc_deps(factory: str, root: Path, dvc_yaml: Path, stage_keys: Sequence[str]) -> None:
    """The factory's module must be a dependency of each of `stage_keys` (the stages that
    build the model) in `dvc.yaml`, so that editing the model re-runs them; a one-line error
    names every stage that lacks it and the line to add."""
    import yaml

    if not dvc_yaml.is_file():
        return
    stages = (yaml.safe_load(dvc_yaml.read_text()) or {}).get("stages") or {}
    try:
        rel = module_file(factory, root).resolve().relative_to(root.resolve())
    except ValueError:  # code above this pipeline's directory: outside what its DVC tracks
        return
    missing = []
    for key in (k for k in stage_keys if k in stages):
        deps = [Path(str(d)) for d in stages[key].get("deps") or [] if "${" not in str(d)]
        if not any(d == rel or d in rel.parents for d in deps):
            missing.append(key)
    if not missing:
        return
    which = f"stage {missing[0]} does" if len(missing) == 1 else f"stages {', '.join(missing)} do"
    raise ConfigError(
        f"{dvc_yaml}: {which} not depend on {rel}, the module of model.factory {factory!r}; "
        f"add '- {rel.parent if rel.name == '__init__.py' else rel}' under the deps of "
        f"{'it' if len(missing) == 1 else 'each'} so that editing your model re-runs training "
        "(docs/your-model.md)"
    )
