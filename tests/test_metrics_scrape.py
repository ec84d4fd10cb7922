"""GET /metrics answered as prometheus_client's own handler (vLLM's) answers a scrape."""

from __future__ import annotations

import asyncio
import gzip

import httpx
from transformers import AutoTokenizer

from server.api_server import build_app
from server.cli import build_parser
from tests.server_fixtures import TINY_MODEL, FakeEngine


def _client() -> httpx.AsyncClient:
    app = build_app(FakeEngine(AutoTokenizer.from_pretrained(TINY_MODEL)),
                    build_parser().parse_args(["--model", str(TINY_MODEL)]))
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")


def test_formats_compression_paths_and_process_series():
    async def run():
        async with _client() as c:
            plain = await c.get("/metrics", headers={"Accept-Encoding": "identity"})
            om = await c.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0",
                                                  "Accept-Encoding": "identity"})
            zipped = await c.send(c.build_request("GET", "/metrics", headers={"Accept-Encoding": "gzip"}),
                                  stream=True)
            raw = b"".join([chunk async for chunk in zipped.aiter_raw()])
            head = await c.head("/metrics")
            slash = await c.get("/metrics/", follow_redirects=False)
            return plain, om, zipped, raw, head, slash
    plain, om, zipped, raw, head, slash = asyncio.run(run())
    assert plain.status_code == 200 and plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "content-encoding" not in plain.headers
    assert om.headers["content-type"].startswith("application/openmetrics-text")
    assert om.text.endswith("# EOF\n") and "vllm:num_requests_running" in om.text
    assert zipped.headers["content-encoding"] == "gzip" and b"vllm:num_requests_running" in gzip.decompress(raw)
    assert head.status_code == 200 and slash.status_code == 200 and "vllm:num_requests_running" in slash.text
    # one process: its own process and Python series, as vLLM's default registry has them
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
                 "python_info", "python_gc_objects_collected_total"):
        assert any(line.startswith(name) for line in plain.text.splitlines()), name
