"""Run a check script on the CPU under the Triton interpreter, in a fresh Python process
(TRITON_INTERPRET must be set before triton is imported, so it cannot run in the test process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_interpreted(code: str, timeout: int = 300) -> str:
    """Runs `code`; fails the test with its stderr unless it exits 0 and its last output line is
    `ok` (so a script that stops early cannot pass). Returns stdout."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code + "\nprint('ok')\n"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0 and r.stdout.rstrip().endswith("ok"), r.stderr[-3000:]
    return r.stdout
