"""The vendored JavaScript is what scripts/vendor_web.py fetched: every file listed in the
manifest, with its sha256, and each package's licence beside it (no network here; the script's
--check compares with the registry)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

VENDOR = Path(__file__).resolve().parents[2] / "web" / "static" / "vendor"


def test_vendored_files_match_the_manifest_and_carry_their_licences():
    manifest = json.loads((VENDOR / "MANIFEST.json").read_text())
    for name, digest in manifest["sha256"].items():
        assert hashlib.sha256((VENDOR / name).read_bytes()).hexdigest() == digest, name
    on_disk = {p.name for p in VENDOR.iterdir()} - {"MANIFEST.json"}
    assert on_disk == set(manifest["sha256"]), "a vendored file is not in the manifest, or one is missing"
    for pkg in manifest["packages"]:
        assert any(f.startswith("LICENSE.") for f in pkg["files"]), pkg["name"]
        assert pkg["integrity"].startswith("sha512-") and pkg["version"][0].isdigit()
