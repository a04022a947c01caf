"""Fixture hosts, each built fresh in its own directory under tmp_path."""
from __future__ import annotations

import pytest

from . import trees


@pytest.fixture
def apu(tmp_path):
    return trees.build(tmp_path / "apu", trees.strix_halo())


@pytest.fixture
def desktop(tmp_path):
    return trees.build(tmp_path / "desktop", trees.nvidia_desktop())


@pytest.fixture
def vm(tmp_path):
    return trees.build(tmp_path / "vm", trees.bare_vm())


@pytest.fixture
def empty(tmp_path):
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"
