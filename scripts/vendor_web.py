#!/usr/bin/env python3
"""Fetch the web pages' third-party JavaScript and CSS, pinned, into web/static/vendor/.

The appliance runs offline, so what its pages load is served by it and committed with it. Each
file comes from the npm registry's tarball of an exact version, checked against the registry's
sha512 integrity string before anything is unpacked, and is written with its licence. The
manifest (web/static/vendor/MANIFEST.json) records the package, version, integrity and each
file's sha256; `tests/web/test_vendor.py` checks the committed files against it.

    python scripts/vendor_web.py          # fetch and write
    python scripts/vendor_web.py --check  # fetch and compare with what is committed

Why these: marked renders markdown (GFM tables and fenced code), DOMPurify sanitises the HTML
that marked produces (a reply with <script> or onerror= stays inert), highlight.js colours code
blocks, uPlot draws the benchmark curves (40 KB, no dependencies).
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import sys
import tarfile
import urllib.request
from pathlib import Path

REGISTRY = "https://registry.npmjs.org"
VENDOR = Path(__file__).resolve().parent.parent / "web" / "static" / "vendor"

# package, version, the registry's integrity string, {file in the tarball: name here}
PINNED = [
    ("marked", "18.2.1",
     "sha512-ii4bxCTCqqwpT86XZWgJNs+ZnAIZksmLGYMViWA7PDIXYIeNo1x6cDdX3JOip9NM/cI6p8z57FxliACboTruMA==",
     {"lib/marked.umd.js": "marked.umd.js", "LICENSE": "LICENSE.marked"}),
    ("dompurify", "3.5.0",
     "sha512-LYC0ZkE8P1V42JsRYTwMdme/2ET8SpOc5AA2eOFjP/IadvRd2fwiT4TVz5vkfy0XUx12aS2UaRkTnfVPNOv9vw==",
     {"dist/purify.min.js": "purify.min.js", "LICENSE": "LICENSE.dompurify"}),
    ("@highlightjs/cdn-assets", "11.12.0",
     "sha512-KvOKXODaiFmId9xaq3xc5xCL66wVLUuOngDbO9B/kewbFTqdGbn2nJxNhN3H5R1cgDTVj6R8vH0zgiNDEGjpDw==",
     {"highlight.min.js": "highlight.min.js", "styles/github.min.css": "hljs-github.min.css",
      "styles/github-dark.min.css": "hljs-github-dark.min.css", "LICENSE": "LICENSE.highlightjs"}),
    ("uplot", "1.6.32",
     "sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==",
     {"dist/uPlot.iife.min.js": "uPlot.iife.min.js", "dist/uPlot.min.css": "uPlot.min.css",
      "LICENSE": "LICENSE.uplot"}),
]


def tarball_url(name: str, version: str) -> str:
    return f"{REGISTRY}/{name}/-/{name.rsplit('/', 1)[-1]}-{version}.tgz"


def fetch(name: str, version: str, integrity: str) -> bytes:
    with urllib.request.urlopen(tarball_url(name, version), timeout=60) as r:
        data = r.read()
    algo, _, want = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise SystemExit(f"{name}@{version}: integrity mismatch ({algo} {got} != {want})")
    return data


def unpack() -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, version, integrity, files in PINNED:
        with tarfile.open(fileobj=io.BytesIO(fetch(name, version, integrity)), mode="r:gz") as tar:
            for src, dst in files.items():
                member = tar.extractfile(f"package/{src}")
                if member is None:
                    raise SystemExit(f"{name}@{version} has no {src}")
                out[dst] = member.read()
    return out


def manifest(files: dict[str, bytes]) -> dict:
    return {"packages": [{"name": n, "version": v, "integrity": i, "files": sorted(f.values())}
                         for n, v, i, f in PINNED],
            "sha256": {dst: hashlib.sha256(data).hexdigest() for dst, data in sorted(files.items())}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = ap.parse_args()
    files = unpack()
    if args.check:
        bad = [dst for dst, data in files.items()
               if not (VENDOR / dst).exists() or (VENDOR / dst).read_bytes() != data]
        print("vendored files match the pinned packages" if not bad else f"differ: {', '.join(bad)}")
        return 1 if bad else 0
    VENDOR.mkdir(parents=True, exist_ok=True)
    for dst, data in files.items():
        (VENDOR / dst).write_bytes(data)
    (VENDOR / "MANIFEST.json").write_text(json.dumps(manifest(files), indent=2) + "\n")
    print(f"wrote {len(files)} files to {VENDOR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
