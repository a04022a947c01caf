"""The fixture hosts (hostcheck's trees) as snapshots, once per session."""
from __future__ import annotations

import pytest

from hostcheck.snapshot import collect
from tests.hostcheck import trees


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    out = {}
    for name, tree, run in (("apu", trees.strix_halo(), trees.strix_halo_runner()),
                            ("desktop", trees.nvidia_desktop(), trees.nvidia_runner()),
                            ("vm", trees.bare_vm(), trees.FakeRunner())):
        root = trees.build(tmp_path_factory.mktemp(name) / name, tree)
        out[name] = collect(root, run, power_interval_s=0, sleep=lambda s: None).to_dict()
    return out
