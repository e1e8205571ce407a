"""The job secret as deploy/k8s/pytorchjob.yaml delivers it (issue 52.3, 52.7): a Kubernetes
Secret volume's file is a link (`secret -> ..data/secret`, `..data -> ..<timestamp>/`, the
kubelet's atomic writer), which the reader accepts as the manifest mounts it; a link that
leads out of its folder, or to a file of another user or readable by others, is still one
line. A secret anyone could guess is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from enn_core.errors import ConfigError
from enn_core.runtime import secret

ROOT = Path(__file__).resolve().parents[3]
KEY = "0f3c9a7be1d24c58a6e0b9d13f72c4e8"


def _manifest_secret() -> tuple[Path, int]:
    """What the shipped manifest mounts: the file ENN_JOB_SECRET_FILE names, and its mode."""
    job = yaml.safe_load((ROOT / "deploy/k8s/pytorchjob.yaml").read_text())
    pod = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    named = Path(env[secret.ENV])
    (volume,) = [v for v in pod["volumes"] if "secret" in v]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount.get("readOnly") is True and "subPath" not in mount
    assert named.parent == Path(mount["mountPath"])
    # the pod runs as the user the file belongs to (the kubelet writes it as root)
    assert pod["securityContext"]["runAsUser"] == 0
    return named, volume["secret"]["defaultMode"]


def _secret_volume(mount: Path, name: str, mode: int, content: str = KEY) -> Path:
    """The files the kubelet's atomic writer makes for a Secret volume at `mount`."""
    stamped = mount / "..2026_11_29_03_04_48.123456789"
    stamped.mkdir(parents=True)
    (stamped / name).write_text(content + "\n")
    (stamped / name).chmod(mode)
    (mount / "..data").symlink_to(stamped.name)
    (mount / name).symlink_to(f"..data/{name}")
    return mount / name


def test_the_manifests_secret_volume_is_read_as_mounted(tmp_path, monkeypatch):
    named, mode = _manifest_secret()
    assert mode in (0o400, 0o440, 0o600)
    path = _secret_volume(tmp_path / named.parent.name, named.name, mode)
    assert path.is_symlink() and (path.parent / "..data").is_symlink()
    monkeypatch.setenv(secret.ENV, str(path))
    assert secret.load() == KEY.encode()
    if os.geteuid() == 0:  # what the kubelet writes: root's files (the pod runs as root)
        os.chown(path.parent / "..data" / named.name, 0, 0)
        assert secret.load() == KEY.encode()


def test_links_that_leave_the_mount_or_reach_others_files_are_refused(tmp_path, monkeypatch):
    mount = tmp_path / "enn"
    path = _secret_volume(mount, "secret", 0o400)
    monkeypatch.setenv(secret.ENV, str(path))
    outside = tmp_path / "mine"
    outside.write_text(KEY)
    outside.chmod(0o600)
    (mount / "..data").unlink()
    (mount / "..data").symlink_to("..")  # ..data/secret -> the folder above the mount
    (tmp_path / "secret").symlink_to(outside)
    with pytest.raises(ConfigError, match=r"link leading out of its folder \(to .*mine\)"):
        secret.load()
    (mount / "..data").unlink()
    (mount / "..data").symlink_to("/etc")
    (mount / "secret").unlink()
    (mount / "secret").symlink_to("..data/passwd")
    with pytest.raises(ConfigError, match="link leading out of its folder"):
        secret.load()
    (mount / "secret").unlink()
    (mount / "secret").symlink_to("..nowhere/secret")
    with pytest.raises(ConfigError, match="leads nowhere"):
        secret.load()
    readable = _secret_volume(tmp_path / "loose", "secret", 0o444)
    monkeypatch.setenv(secret.ENV, str(readable))
    with pytest.raises(ConfigError, match="readable by others .*chmod 600"):
        secret.load()
    if os.geteuid() != 0:
        return  # planting another user's file or link needs root (CI and the dev machine are)
    theirs = _secret_volume(tmp_path / "theirs", "secret", 0o400)
    os.chown(theirs.parent / "..data" / "secret", 1235, 1235, follow_symlinks=False)
    monkeypatch.setenv(secret.ENV, str(theirs))
    with pytest.raises(ConfigError, match="belongs to uid 1235, not to this user"):
        secret.load()
    planted = _secret_volume(tmp_path / "planted", "secret", 0o400)
    os.chown(planted, 1235, 1235, follow_symlinks=False)  # another user's link to my file
    monkeypatch.setenv(secret.ENV, str(planted))
    with pytest.raises(ConfigError, match="link of uid 1235"):
        secret.load()


@pytest.mark.parametrize("content", ["a" * 16, "ab" * 32, " " + "7" * 40 + "\n"])
def test_a_secret_anyone_could_guess_is_one_line(tmp_path, monkeypatch, content):
    path = tmp_path / "s"
    path.write_text(content)
    path.chmod(0o600)
    monkeypatch.setenv(secret.ENV, str(path))
    with pytest.raises(ConfigError, match="distinct character.*anyone could guess") as e:
        secret.load()
    assert "\n" not in str(e.value) and content.strip() not in str(e.value)
