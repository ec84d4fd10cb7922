"""Does a slow grammar compile hold up everyone else? Against a running server: one client streams
greedy completions back to back (the victim) while K clients send one large `guided_grammar` each
(a Lark alternation of N strings, which takes llguidance seconds to compile and, past ~65,000
symbols, then fails on one of its limits); /health is probed every second. Prints the victim's
longest pause between two streamed chunks, the attackers' statuses and times, and the /health
answers that were not 200.

  python -m server --model configs/models/tiny-deepseek-v3 --port 8791 &
  python scripts/bench_grammar_stall.py --url http://127.0.0.1:8791 --alternatives 200000 --clients 4
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import threading
import time

import httpx

PROMPT = "Question: Mia has 7 apples and buys 3 more. How many apples does she have?\nAnswer:"


def victim(url: str, model: str, stop: threading.Event, out: dict) -> None:
    """Streams 200-token completions until `stop`; records the longest gap between chunks."""
    worst, streams = 0.0, 0
    with httpx.Client(timeout=600) as c:
        while not stop.is_set():
            body = {"model": model, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            with c.stream("POST", f"{url}/v1/completions", json=body) as r:
                last = time.monotonic()
                for line in r.iter_lines():
                    now = time.monotonic()
                    if line:
                        worst, last = max(worst, now - last), now
            streams += 1
    out.update(longest_pause_s=round(worst, 3), victim_streams=streams)


def health(url: str, stop: threading.Event, bad: list) -> None:
    with httpx.Client(timeout=60) as c:
        while not stop.is_set():
            t = time.monotonic()
            r = c.get(f"{url}/health")
            if r.status_code != 200:
                bad.append((round(t, 1), r.status_code, r.text[:120]))
            stop.wait(1.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--alternatives", type=int, default=200_000, help="strings in each attacker's grammar")
    ap.add_argument("--clients", type=int, default=4, help="attackers, sent at once")
    a = ap.parse_args()
    model = httpx.get(f"{a.url}/v1/models", timeout=30).json()["data"][0]["id"]
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(a.alternatives))
    stop, result, bad = threading.Event(), {}, []
    threads = [threading.Thread(target=victim, args=(a.url, model, stop, result)),
               threading.Thread(target=health, args=(a.url, stop, bad))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the victim is streaming

    def attack(_):
        t0 = time.monotonic()
        r = httpx.post(f"{a.url}/v1/completions", timeout=1200, json={
            "model": model, "prompt": PROMPT, "max_tokens": 5, "guided_grammar": grammar})
        return r.status_code, round(time.monotonic() - t0, 1), r.text[:160]

    with cf.ThreadPoolExecutor(a.clients) as ex:
        answers = list(ex.map(attack, range(a.clients)))
    stop.set()
    for t in threads:
        t.join()
    for status, seconds, text in answers:
        print(f"attacker: {status} after {seconds} s: {text}")
    print(f"victim: longest pause between chunks {result['longest_pause_s']} s over "
          f"{result['victim_streams']} streams; /health not 200: {len(bad)} times {bad[:3]}")


if __name__ == "__main__":
    main()
