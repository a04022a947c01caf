#!/usr/bin/env python3
"""What each page of the web app loads on a first visit (an empty browser cache): requests and
bytes, measured in headless Chromium against `appliance serve` on the embedded model.

    python scripts/page_weight.py [--chromium PATH]

Bytes are the response bodies as served (waitress sends them uncompressed on loopback).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from urllib.parse import urlparse

import requests
from playwright.sync_api import sync_playwright

PAGES = ("/", "/host", "/bench")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weigh(browser, url: str) -> tuple[int, Counter]:
    context = browser.new_context()
    page = context.new_page()
    sizes: Counter = Counter()
    page.on("response", lambda r: sizes.update({urlparse(r.url).path: len(r.body())}))
    page.goto(url, wait_until="networkidle")
    context.close()
    return sum(sizes.values()), sizes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chromium", default=shutil.which("chromium") or shutil.which("chromium-browser"))
    args = ap.parse_args()
    port, tmp = free_port(), tempfile.mkdtemp()
    env = {**os.environ, "APPLIANCE_CONVERSATIONS_DB": f"{tmp}/c.db", "APPLIANCE_DB_PATH": f"{tmp}/r.db",
           "APPLIANCE_CACHE_DIR": f"{tmp}/cache", "APPLIANCE_PLAN": "off"}
    server = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--port", str(port), "--n-ctx", "512",
                               "--n-slots", "1"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
            for path in PAGES:
                total, sizes = weigh(browser, url + path)
                print(f"{path:7s} {total:>9,} bytes in {len(sizes)} responses: "
                      + ", ".join(f"{k} {v:,}" for k, v in sizes.most_common()))
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
