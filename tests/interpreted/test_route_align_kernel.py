"""The one-launch expert choice and alignment on the CPU: the checks of tests/test_route_align.py."""

from __future__ import annotations

import pytest
from test_route_align import CASES, check


@pytest.mark.parametrize("case", CASES)
def test_route_align_interpreter(case):
    check("cpu", *case)

