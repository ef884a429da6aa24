"""``--launcher``, ``--ray-address`` and ``--storage-path`` (herald/contracts/train.py; docs/cluster.md):
checked before anything starts, naming the flag and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from herald.cli import main
from herald.contracts.train import TrainConfig
from herald.errors import ConfigError


def test_the_ray_settings_need_the_ray_launcher():
    for name, value in (("ray_address", "auto"), ("storage_path", "/mnt/shared")):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} is a setting of the Ray launcher"):
            TrainConfig.from_flags(**{name: value})
    with pytest.raises(ConfigError, match="--launcher must be one of local, ray"):
        TrainConfig.from_flags(launcher="k8s")
    assert TrainConfig().launcher.name == "local"


def test_the_storage_path_holds_the_run_folder():
    cfg = TrainConfig.from_flags(launcher="ray", storage_path="/mnt/shared", run_dir="runs/a")
    assert cfg.run_dir == "/mnt/shared/runs/a"
    assert dataclasses.replace(cfg, resume=True).run_dir == "/mnt/shared/runs/a"  # kept, not joined twice
    assert (
        TrainConfig.from_flags(launcher="ray", storage_path="/mnt/shared", run_dir="/mnt/shared/b").run_dir
        == "/mnt/shared/b"
    )
    for outside in ("/elsewhere", "../up"):
        with pytest.raises(ConfigError, match="is outside --storage-path"):
            TrainConfig.from_flags(launcher="ray", storage_path="/mnt/shared", run_dir=outside)


@pytest.mark.parametrize(
    "settings,words",
    [
        (dict(ray_address="ray://head:10001"), "Ray Client"),
        (dict(device="cuda:1"), "use --device cuda"),
        (dict(pin_cores=True), "leave --pin-cores out"),
    ],
)
def test_what_the_ray_launcher_cannot_do_is_refused(settings, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig.from_flags(launcher="ray", **settings)


def test_herald_train_refuses_them_before_anything_starts(capsys):
    assert main(["train", "--storage-path", "/mnt/shared"]) == 2
    assert "--storage-path is a setting of the Ray launcher: add --launcher ray" in capsys.readouterr().err
