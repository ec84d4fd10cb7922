"""`pytest --shard I/N` (tests/conftest.py, tests/sharding.py), which gpu_check.sh's quick step
runs N of side by side."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from sharding import shard


def test_shards_cover_the_selection_once():
    items = list(range(11))
    parts = [shard(items, f"{i}/3") for i in range(3)]
    assert [kept for kept, _ in parts] == [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8]]
    for kept, dropped in parts:
        assert sorted(kept + dropped) == items
    for bad in ("3/3", "-1/2", "1", "a/b", "1/0"):
        with pytest.raises(pytest.UsageError):
            shard(items, bad)


def test_shard_applies_after_k_deselection(tmp_path):
    """With -k and --shard the shard splits the tests -k selected: shard 1/2 of test_a's 7 is
    test_a 1, 3, 5. Sharding the whole collection first (test_b's 5, then test_a's) would give
    test_a 0, 2, 4, 6."""
    (tmp_path / "conftest.py").write_text((Path(__file__).parent / "conftest.py").read_text())
    (tmp_path / "test_many.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('n', range(5))\ndef test_b(n):\n    pass\n\n"
        "@pytest.mark.parametrize('n', range(7))\ndef test_a(n):\n    pass\n")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co", "-k", "test_a",
                          "--shard=1/2", str(tmp_path / "test_many.py")], cwd=tmp_path, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert [ln.split("::")[-1] for ln in out.stdout.splitlines() if "::" in ln] == \
        ["test_a[1]", "test_a[3]", "test_a[5]"]
