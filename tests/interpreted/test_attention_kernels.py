"""The Triton attention ops (decode, prefill, KV write, context gather) on small CPU shapes
against the torch reference: the cases of tests/test_triton_ops.py `CPU_CASES`."""

from __future__ import annotations

import pytest
from test_triton_ops import CPU_CASES


@pytest.mark.parametrize("name", sorted(CPU_CASES))
def test_attention_kernel(name):
    CPU_CASES[name]()
