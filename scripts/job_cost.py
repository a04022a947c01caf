"""What a chat job costs when no tab watches it, against the same request sent to /v1 directly:
the same greedy prompt and max_tokens, the two alternated RUNS times on a running server; each
run's decode rate as the engine timed it (timings.predicted_per_second) and its tokens over the
wall time (/v1: the client's, first byte sent to the stream's end; the job: its row's created_at
to updated_at, with nobody subscribed: a GET of the job's state every POLL_S s only).
docs/web-app.md quotes it.

    python scripts/job_cost.py http://127.0.0.1:8080 [RUNS] [MAX_TOKENS]
"""
import datetime
import json
import statistics
import sys
import time

import requests

POLL_S = 0.5
PROMPT = "Write a long story about a lighthouse keeper and the storm that came one winter."


def direct(url: str, max_tokens: int) -> tuple[float, float]:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    timings, tokens = {}, 0
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                timings = chunk.get("timings", timings)
                tokens = chunk.get("usage", {}).get("completion_tokens", tokens)
    return timings["predicted_per_second"], tokens / (time.perf_counter() - t0)


def job(url: str, max_tokens: int) -> tuple[float, float]:
    conv = requests.post(url + "/api/conversations", json={"title": "job cost", "messages": [
        {"role": "user", "content": PROMPT}]}, timeout=30).json()
    body = {"request": {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
                        "temperature": 0}, "position": 1}
    started = requests.post(f"{url}/api/conversations/{conv['id']}/jobs", json=body, timeout=600).json()
    while (j := requests.get(f"{url}/api/jobs/{started['id']}", timeout=30).json())["state"] == "running":
        time.sleep(POLL_S)
    reply = requests.get(f"{url}/api/conversations/{conv['id']}", timeout=30).json()["messages"][1]
    requests.delete(f"{url}/api/conversations/{conv['id']}", timeout=30)
    wall = (datetime.datetime.fromisoformat(j["updated_at"]) - datetime.datetime.fromisoformat(j["created_at"]))
    return reply["timings"]["predicted_per_second"], reply["timings"]["predicted_n"] / wall.total_seconds()


def main() -> None:
    url = sys.argv[1].rstrip("/")
    runs = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    max_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 256
    got: dict[str, list[tuple[float, float]]] = {"v1": [], "job": []}
    for _ in range(runs):
        got["v1"].append(direct(url, max_tokens))
        got["job"].append(job(url, max_tokens))
    for name, rows in got.items():
        engine, wall = zip(*rows)
        print(f"{name:4s} engine decode {statistics.median(engine):7.1f} tok/s  over the wall "
              f"{statistics.median(wall):7.1f} tok/s  (runs: {', '.join(f'{e:.1f}/{w:.1f}' for e, w in rows)})")
    ratio = statistics.median(e for e, _ in got["job"]) / statistics.median(e for e, _ in got["v1"])
    print(f"job / v1 engine decode rate: {ratio:.3f}")


if __name__ == "__main__":
    main()
