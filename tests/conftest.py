"""Session-wide test set-up, imported by pytest before any test module.

Triton reads `TRITON_INTERPRET` when it is first imported (transformers imports it while the test
modules are collected), so the interpreter is switched on here, once, for the whole session: on a
machine without CUDA every Triton kernel the tests reach (the `triton` attention backend, the
`kernel` page-copy io backend) runs interpreted, whatever the order the tests run in.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
