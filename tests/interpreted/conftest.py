"""Test modules that run Triton kernels on the CPU under TRITON_INTERPRET=1 (fp32/fp16 only: the
interpreter's bf16 dot is wrong). The variable must be set before triton is imported, so these
modules never run in the main test process: tests/test_interpreted.py runs them all in one
subprocess. To run them alone: `TRITON_INTERPRET=1 python -m pytest tests/interpreted`."""

import os

if os.environ.get("TRITON_INTERPRET") != "1":
    collect_ignore_glob = ["test_*.py"]
