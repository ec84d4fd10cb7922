"""Does a slow grammar hold up everyone else? Against a running server, two ways.

Default: one client streams greedy completions back to back (the victim) while K clients send
one large `guided_grammar` each (a Lark alternation of N strings, which takes llguidance seconds
to compile and, past ~65,000 symbols, then fails on one of its limits); /health is probed every
second. Prints the victim's longest pause between two streamed chunks, the attackers' statuses
and times, and the /health answers that were not 200.

--checks: K clients send distinct valid ~900 KB grammars (1,000 x 60 strings: seconds for the
front end to check each), and one second later a plain request, a request with an already-used
small constraint and a request whose echoed logprobs make a large answer are timed.

  python -m server --model configs/models/tiny-deepseek-v3 --port 8791 &
  python scripts/bench_grammar_stall.py --url http://127.0.0.1:8791 --alternatives 200000 --clients 4
  python scripts/bench_grammar_stall.py --url http://127.0.0.1:8791 --checks --clients 12
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


def checks(url: str, model: str, clients: int) -> None:
    def big(k: int) -> str:
        t = f"k{k}_{time.monotonic_ns()}_"
        return "\n".join(["start: " + " | ".join(f'"{t}{a}_" r{a}' for a in range(1000))]
                         + [f"r{a}: " + " | ".join(f'"{t}{a}x{b}"' for b in range(60)) for a in range(1000)])

    def timed(body: dict) -> tuple[int, float]:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", timeout=1200, json={"model": model, **body})
        return r.status_code, round(time.monotonic() - t0, 2)
    probes = {"plain": {"prompt": "hi", "max_tokens": 5},
              "used small constraint": {"prompt": "hi", "max_tokens": 5, "guided_choice": ["yes", "no"]},
              "large answer": {"prompt": [i % 500 + 1 for i in range(1000)], "max_tokens": 1, "echo": True,
                               "logprobs": 20}}
    print("idle:", {name: timed(body) for name, body in probes.items()})
    with cf.ThreadPoolExecutor(clients + len(probes)) as ex:
        attackers = [ex.submit(timed, {"prompt": "hi", "max_tokens": 4, "guided_grammar": big(k)})
                     for k in range(clients)]
        time.sleep(1.0)
        during = {name: ex.submit(timed, body) for name, body in probes.items()}
        print("during:", {name: f.result() for name, f in during.items()})
        print("grammar clients:", [f.result() for f in attackers])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--alternatives", type=int, default=200_000, help="strings in each attacker's grammar")
    ap.add_argument("--clients", type=int, default=4, help="attackers, sent at once")
    ap.add_argument("--checks", action="store_true", help="time other requests while large grammars are checked")
    a = ap.parse_args()
    model = httpx.get(f"{a.url}/v1/models", timeout=30).json()["data"][0]["id"]
    if a.checks:
        return checks(a.url, model, a.clients)
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
