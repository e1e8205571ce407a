"""A params file is read as bounded YAML: an alias bomb, deep nesting, a huge or binary file
and a duplicate key are each one ConfigError naming the file (and line), never a hang, a
RecursionError or a silently dropped section; every command that reads the file says the same
line. `--set` values are held to the same bounds, and a float `--set` writes into the file is
read back as a number."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from enn_core.config import load_config
from enn_core.errors import ConfigError
from tests.fixtures.cli import enn

MAX_BYTES, MAX_DEPTH = 256 << 10, 32  # enn_core/config/yaml_file.py
CUSTOM = "model:\n  preset: custom\n  factory: examples.tcn.model:build\n"


def params(tmp_path: Path, text: str, name: str = "params.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def bomb(levels: int = 9, width: int = 9) -> str:
    """`width` aliases of the previous anchor at each of `levels` levels: width^levels values."""
    lines = [CUSTOM + "  options:", f"    a0: &a0 [{', '.join(['x'] * width)}]"]
    for i in range(1, levels):
        lines.append(f"    a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * width)}]")
    return "\n".join(lines) + "\n"


@pytest.mark.timeout(30)  # it hung for minutes: the config builder walked 9^9 values
def test_an_alias_bomb_is_refused(tmp_path):
    path = params(tmp_path, bomb())
    with pytest.raises(ConfigError, match=r"params.yaml:\d+: holds more than .* values once its"):
        load_config(path)


def test_a_few_aliases_still_work(tmp_path):
    text = "train:\n  lr: &lr 0.02\n  min_lr_ratio: 0.1\n  weight_decay: *lr\n"
    assert load_config(params(tmp_path, text)).train.weight_decay == 0.02
    merged = params(tmp_path, "train:\n  <<: {lr: 0.1, epochs: 3}\n  lr: 0.2\n", "m.yaml")
    assert load_config(merged).train.lr == 0.2  # a merge key's value may be overridden


def test_a_value_that_contains_itself_is_one_line(tmp_path):
    """`options: &a {k: *a}` built a dict containing itself: a RecursionError traceback."""
    for text in (CUSTOM + "  options: &a {k: *a}\n", "tune:\n  enqueue: &e [{train.lr: *e}]\n"):
        with pytest.raises(ConfigError, match=r"params.yaml:\d+: alias \*\w refers to the node"):
            load_config(params(tmp_path, text))
    with pytest.raises(ConfigError, match=r"top level must be a mapping"):
        load_config(params(tmp_path, "[]\n"))


def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path):
    path = params(tmp_path, CUSTOM + "  options: {a: " + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(ConfigError, match=rf"params.yaml:4: nested more than {MAX_DEPTH} levels"):
        load_config(path)


def test_a_huge_binary_or_unreadable_file_is_refused_unread(tmp_path):
    big = tmp_path / "big.yaml"
    with open(big, "wb") as f:  # sparse: the size alone refuses it
        f.truncate(50 << 20)
    with pytest.raises(ConfigError, match=r"big.yaml: larger than 256 KiB"):
        load_config(big)
    with pytest.raises(ConfigError, match=r"larger than 256 KiB"):
        load_config("/dev/zero")  # it read forever
    binary = tmp_path / "b.yaml"
    binary.write_bytes(b"\xff\xfe\x00train: {}")
    with pytest.raises(ConfigError, match=r"b.yaml: not UTF-8 text \(byte 0\)"):
        load_config(binary)
    with pytest.raises(ConfigError, match=r"cannot be read \(Is a directory\)"):
        load_config(tmp_path)
    assert MAX_BYTES >= 50 * len((Path(__file__).parents[3] / "params.yaml").read_bytes())


@pytest.mark.parametrize(
    ("text", "line", "key", "first"),
    [
        ("train:\n  lr: 0.1\n  lr: 0.2\n", 3, "'lr' in train", 2),
        ("train:\n  lr: 0.1\nmodel: {}\ntrain:\n  epochs: 3\n", 4, "'train'", 1),
        (
            "tune:\n  space:\n    train.lr: {low: 0.001, high: 0.1}\n"
            "    train.lr: {low: 0.01, high: 0.2}\n",
            4,
            "'train.lr' in tune.space",
            3,
        ),
        (
            "model:\n  preset: custom\n  factory: a.b:c\n  options: {k: 1, k: 2}\n",
            4,
            "'k' in model.options",
            4,
        ),
    ],
)
def test_a_duplicate_key_names_the_key_and_both_lines(tmp_path, text, line, key, first):
    path = params(tmp_path, text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"{path}:{line}: duplicate key {key} (first on line {first})")


COMMANDS = (
    ("stage-data",),
    ("run",),
    ("run", "--flow", "training", "--until", "validate"),
    ("tune",),
    ("tune", "--apply"),
    ("gc", "--dry-run"),
    ("doctor", "--quick"),
    ("ui",),
    ("deploy",),
)


def test_every_command_says_the_same_line_about_a_duplicate_key(tmp_path):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    path = params(tmp_path, "train:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n")
    want = f"error: {path}:4: duplicate key 'lr' in train (first on line 2); YAML would keep"
    for argv in COMMANDS:
        code, lines = enn(tmp_path, *argv)
        assert code == 2 and len(lines) == 1 and lines[0].startswith(want), (argv, lines)
    assert not (tmp_path / "work").exists()  # refused before anything was made


def test_set_values_are_held_to_the_same_bounds(tmp_path):
    path = params(tmp_path, CUSTOM)
    deep = "model.options={a: " + "[" * 2000 + "]" * 2000 + "}"
    with pytest.raises(ConfigError, match=r"--set model.options:1: nested more than"):
        load_config(path, [deep])
    with pytest.raises(ConfigError, match=r"--set model.options:1: duplicate key 'k' \(first"):
        load_config(path, ["model.options={k: 1, k: 2}"])


def test_a_float_set_writes_reads_back_as_a_number(tmp_path):
    """ruamel wrote `1e-05`, which YAML 1.1 (the loader) reads as the string '1e-05': the next
    command failed on the file the previous one wrote."""
    from flows.params_file import apply_overrides

    path = params(tmp_path, "train:\n  lr: 0.01  # tuned\n")
    apply_overrides(path, ["train.lr=1.0e-05", "train.weight_decay=1.0e+20"])
    assert "# tuned" in path.read_text()
    cfg = load_config(path)
    assert cfg.train.lr == 1e-05 and cfg.train.weight_decay == 1e20
    assert yaml.safe_load(path.read_text())["train"]["lr"] == 1e-05


def test_the_bounds_leave_the_shipped_configs_alone():
    root = Path(__file__).parents[3]
    for path in [root / "params.yaml", *sorted((root / "configs").glob("*.yaml"))]:
        load_config(path)
    assert os.path.getsize(root / "params.yaml") < MAX_BYTES
