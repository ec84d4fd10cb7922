"""The Triton decode kernel with multi-token queries and DCP's per-token mask, on small CPU shapes
against the torch reference and the dense oracle: the cases of tests/test_multi_token_decode.py."""

from __future__ import annotations

import pytest
from test_multi_token_decode import CPU_CASES, check_case


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_multi_token_decode_kernel(name):
    check_case(**CPU_CASES[name])
