"""The FP8 latent cache's Triton writes and reads on small CPU shapes against the torch
reference: the cases of tests/test_kv_cache_fp8.py `CPU_CASES`."""

from __future__ import annotations

import pytest
from test_kv_cache_fp8 import CPU_CASES


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_kv_cache_fp8_kernel(name):
    CPU_CASES[name]()
