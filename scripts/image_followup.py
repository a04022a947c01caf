"""The follow-up turn of a conversation with a picture, on the tiny vision pair the tests write
(tests/engine/mmproj_fixture.py): how much of turn 2's prompt the prompt cache holds, its
prompt time against the same turn with cache_prompt false, and whether the replies agree.
docs/images.md cites its figures.

    python scripts/image_followup.py [--runs 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.mmproj_fixture import picture, write_vision_pair  # noqa: E402
from tests.web.conftest import running_server  # noqa: E402
from tests.web.test_images_e2e import LONG, image_message  # noqa: E402


def chat(url: str, messages: list[dict], **extra) -> dict:
    body = {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=120).json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        model, mmproj = write_vision_pair(d)
        with running_server(Path(d), "--model", str(model), "--mmproj", str(mmproj), "--n-ctx", "512",
                            "--n-slots", "2") as s:
            warm_ms, cold_ms = [], []
            for seed in range(10, 10 + args.runs):
                turn1 = [{"role": "user", "content": image_message(picture(seed=seed), LONG)}]
                first = chat(s.url, turn1)
                turn2 = turn1 + [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                                 {"role": "user", "content": "And the colours?"}]
                warm, cold = chat(s.url, turn2), chat(s.url, turn2, cache_prompt=False)
                warm_ms.append(warm["timings"]["prompt_ms"])
                cold_ms.append(cold["timings"]["prompt_ms"])
                same = warm["choices"][0]["message"] == cold["choices"][0]["message"]
                print(f"turn 1 {first['usage']['prompt_tokens']} tokens; turn 2 {warm['usage']['prompt_tokens']}, "
                      f"{warm['usage']['prompt_tokens_details']['cached_tokens']} cached; prompt "
                      f"{warm_ms[-1]:.1f} ms warm, {cold_ms[-1]:.1f} ms cold; same reply: {same}")
            print(f"median prompt ms: warm {statistics.median(warm_ms):.1f}, cold {statistics.median(cold_ms):.1f}")


if __name__ == "__main__":
    main()
