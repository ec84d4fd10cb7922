"""Runs the test modules of tests/interpreted/ in one TRITON_INTERPRET=1 subprocess (pytest in it)
and reports each module here: every one of its tests must pass, and at least one must run."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(p.name for p in (REPO / "tests" / "interpreted").glob("test_*.py"))


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict[str, list[tuple[str, str | None]]]:
    """{module file: [(test name, failure text or None)]} from one pytest run under the interpreter."""
    report = tmp_path_factory.mktemp("interpreted") / "report.xml"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interpreted",
                        f"--junitxml={report}"], cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert report.exists(), r.stdout[-3000:] + r.stderr[-3000:]
    out: dict[str, list] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1] + ".py"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped") is not None
        out.setdefault(module, []).append((case.get("name"), None if bad is None else
                                           (bad.get("message", "") + "\n" + (bad.text or ""))[-3000:],
                                           skipped))
    return out


@pytest.mark.parametrize("module", MODULES)
def test_interpreted_module(results, module):
    cases = results.get(module, [])
    ran = [c for c in cases if not c[2]]
    assert ran, f"no test of tests/interpreted/{module} ran"
    failed = [f"{name}: {msg}" for name, msg, _ in cases if msg is not None]
    assert not failed, "\n\n".join(failed)
