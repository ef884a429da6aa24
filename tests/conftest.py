"""Shared fixtures: where the real data lives."""

from __future__ import annotations

import os
import pathlib
import sys

import pytest
from hypothesis import settings

# CI replays the same examples every run (a red CI must mean a regression, not a new
# random draw); locally every run explores new inputs.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI", "").lower() == "true":
    settings.load_profile("ci")

# Every PS table directory is checked after each publish (NOTE [table directory]), here and
# in the shard processes the tests start (they inherit the environment).
os.environ.setdefault("HERALD_PS_DEBUG", "1")

REPO = pathlib.Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # ``from tests.fakes import ...`` however pytest was started
    sys.path.append(str(REPO))
DATA = pathlib.Path(os.environ.get("HERALD_DATA", REPO.parent / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> pathlib.Path:
    """``../shared/data`` relative to the repository root (override with HERALD_DATA)."""
    if not DATA.is_dir():
        pytest.fail(
            f"real data folder {DATA} is missing: the tests read ../shared/data beside the repository "
            "(set HERALD_DATA to its path)"
        )
    return DATA
