"""Runs the test modules of tests/interpreted/ in one TRITON_INTERPRET=1 subprocess (pytest in it),
started in the background as soon as the session's tests are collected, and reports each module
here: every one of its tests must pass, and at least one must run."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MODULES = sorted(p.name for p in (REPO / "tests" / "interpreted").glob("test_*.py"))


def start(config) -> None:
    """Start the interpreter's pytest run in the background (called from conftest.py once the
    session's tests are collected, when this file's are among them): the run is single-threaded
    and takes minutes, so it overlaps the rest of the session (conftest.py puts this file's
    tests, which wait for it, last) instead of following it on a 2-core machine."""
    if getattr(config, "_interpreted_run", None) is not None:
        return
    out = Path(tempfile.mkdtemp(prefix="interpreted-"))
    log = open(out / "log.txt", "w")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/interpreted",
                             f"--junitxml={out / 'report.xml'}"], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    config._interpreted_run = (proc, out, log)


def stop(config) -> None:
    """End a background run still going when the session ends (a -x stop, an interrupt)."""
    run = getattr(config, "_interpreted_run", None)
    if run is not None and run[0].poll() is None:
        run[0].kill()
        run[0].wait()


@pytest.fixture(scope="module")
def results(request) -> dict[str, list[tuple[str, str | None]]]:
    """{module file: [(test name, failure text or None)]} from one pytest run under the interpreter."""
    start(request.config)
    proc, out, log = request.config._interpreted_run
    try:
        proc.wait(timeout=1800)
    finally:
        stop(request.config)
        log.close()
    report = out / "report.xml"
    assert report.exists(), (out / "log.txt").read_text()[-6000:]
    cases: dict[str, list] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")[-1] + ".py"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped") is not None
        cases.setdefault(module, []).append((case.get("name"), None if bad is None else
                                             (bad.get("message", "") + "\n" + (bad.text or ""))[-3000:],
                                             skipped))
    return cases


@pytest.mark.parametrize("module", MODULES)
def test_interpreted_module(results, module):
    cases = results.get(module, [])
    ran = [c for c in cases if not c[2]]
    assert ran, f"no test of tests/interpreted/{module} ran"
    failed = [f"{name}: {msg}" for name, msg, _ in cases if msg is not None]
    assert not failed, "\n\n".join(failed)
