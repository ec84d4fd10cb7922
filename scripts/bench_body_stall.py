"""Does one huge request body hold up everyone else? Against a running server: one client streams
greedy completions back to back (the victim) while large bodies are sent one at a time; prints,
for each body, its size, the answer and its time, and the victim's longest pause between two
streamed chunks while it was handled.

  python -m server --model configs/models/tiny-deepseek-v3 --port 8791 &
  python scripts/bench_body_stall.py --url http://127.0.0.1:8791
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx


def bodies(model: str, scale: float) -> list[tuple[str, str, bytes]]:
    """(name, path, body): each near the default 16 MB body limit at scale 1."""
    def n(k: int) -> int:
        return max(1, int(k * scale))
    chat = {"model": model, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}] * n(450_000)}
    lists = {"model": model, "max_tokens": 1, "prompt": [[1, 2, 3]] * n(1_000_000)}
    ids = {"model": model, "max_tokens": 1, "prompt": [5] * n(5_000_000)}
    bias = {"model": model, "max_tokens": 1, "prompt": "hi", "logit_bias": {str(i): 1 for i in range(n(1_000_000))}}
    text = {"model": model, "max_tokens": 1, "prompt": "ab " * n(5_000_000)}
    detok = {"model": model, "tokens": [5] * n(5_000_000)}
    return [(f"chat, {len(chat['messages'])} messages", "/v1/chat/completions", chat),
            (f"completion, {len(lists['prompt'])} token-id prompts", "/v1/completions", lists),
            (f"completion, one prompt of {len(ids['prompt'])} ids", "/v1/completions", ids),
            (f"logit_bias of {len(bias['logit_bias'])} entries", "/v1/completions", bias),
            (f"one prompt of {len(text['prompt'])} characters", "/v1/completions", text),
            (f"/detokenize of {len(detok['tokens'])} ids", "/detokenize", detok)]


class Victim(threading.Thread):
    """Streams 200-token completions until stopped; `worst` is the longest gap between chunks
    since the last `reset()`."""

    def __init__(self, url: str, model: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.worst, self.stop = url, model, 0.0, threading.Event()

    def reset(self) -> None:
        self.worst = 0.0

    def run(self) -> None:
        body = {"model": self.model, "prompt": "Question: 2 + 2?\nAnswer:", "max_tokens": 200,
                "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(timeout=600) as c:
            while not self.stop.is_set():
                with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    last = time.monotonic()
                    for _ in r.iter_lines():
                        now = time.monotonic()
                        self.worst, last = max(self.worst, now - last), now


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--scale", type=float, default=1.0, help="body sizes relative to ~16 MB")
    ap.add_argument("--only", default="", help="send only the bodies whose name holds this")
    a = ap.parse_args()
    model = httpx.get(f"{a.url}/v1/models", timeout=30).json()["data"][0]["id"]
    victim = Victim(a.url, model)
    victim.start()
    time.sleep(3)
    victim.reset()
    time.sleep(2)
    print(f"idle: the victim's longest pause {victim.worst:.3f} s")
    for name, path, body in bodies(model, a.scale):
        if a.only not in name:
            continue
        data = json.dumps(body).encode()
        time.sleep(1)
        victim.reset()
        t0 = time.monotonic()
        r = httpx.post(a.url + path, content=data, headers={"content-type": "application/json"}, timeout=600)
        took = time.monotonic() - t0
        time.sleep(1)
        msg = r.json().get("error", {}).get("message", "")[:90] if r.status_code != 200 else "ok"
        print(f"{name} ({len(data) / 1e6:.1f} MB): {r.status_code} in {took:.2f} s ({msg}); "
              f"the victim's longest pause {victim.worst:.3f} s")
    victim.stop.set()


if __name__ == "__main__":
    main()
