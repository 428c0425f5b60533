"""What a CUDA graph captures, checked on CPU: the decode forward over the static buffers
(`model(DecodeGraphInputs.batch(bs), attn)` with the `triton` backend, interpreted here) must not
sync with the host (`.item()`, `.tolist()`, `.cpu()`, Python branching on a tensor...) nor
create a tensor without a device (a CPU tensor in a CUDA graph) in our own code. Any of those
fails only at capture on a GPU; here a torch function mode sees every call and its caller."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine.attention import ForwardBatch
from engine.cuda_graph import DecodeGraphInputs

ROOT = Path(__file__).resolve().parents[2]
OURS = tuple(str(ROOT / d) for d in ("engine", "hicache"))
SYNCS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
         "nonzero", "masked_select", "unique"}
FACTORIES = {"arange", "zeros", "ones", "empty", "full", "tensor", "as_tensor", "randn", "rand",
             "randint", "linspace", "eye", "empty_strided"}


class CaptureGuard(TorchFunctionMode):
    """Records host syncs and device-less tensor creations made directly by our code."""

    def __init__(self) -> None:
        super().__init__()
        self.bad: list[str] = []
        self.ours = 0  # calls made by our code (the guard saw the forward at all)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        caller = sys._getframe(1)
        where = f"{caller.f_code.co_filename}:{caller.f_lineno}"
        if caller.f_code.co_filename.startswith(OURS):
            self.ours += 1
            if name in SYNCS:
                self.bad.append(f"{name} at {where}")
            elif name in FACTORIES and "device" not in kwargs:
                self.bad.append(f"torch.{name} without device at {where}")
            elif name == "to" and any(
                    (isinstance(a, (str, torch.device)) and torch.device(a).type == "cpu")
                    for a in list(args[1:]) + [kwargs.get("device")] if a is not None):
                self.bad.append(f".to(cpu) at {where}")
        return func(*args, **kwargs)


def test_guard_catches_syncs_and_deviceless_tensors() -> None:
    """The guard itself: a forward that syncs is caught (else the real check could not fail)."""
    guard = CaptureGuard()
    code = compile(
        "t = torch.ones(2, device='cpu')\nif t[0] > 0:\n    t.tolist()\nx = torch.arange(3)\n",
        str(ROOT / "engine" / "fake_module.py"), "exec")
    with guard:
        exec(code, {"torch": torch})
    assert [b.split(" at ")[0] for b in guard.bad] == [
        "__bool__", "tolist", "torch.arange without device"]


def test_captured_decode_forward_has_no_host_sync(checkpoint_factory: Callable[..., Path]) -> None:
    pytest.importorskip("triton", reason="needs the triton package")  # interpreted: conftest
    from engine.model_runner import ModelRunner
    from engine.models import load_model

    # The kernels' device: CPU runs them under Triton's interpreter, which tests/conftest.py
    # turns on only where there is no CUDA (with CUDA, a CPU pool would reach compiled kernels).
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    path = checkpoint_factory("llama", with_tokenizer=False, layers=2)
    model = load_model(path, device=dev)
    runner = ModelRunner(model, num_pages=24, page_size=4, dtype=torch.float32, device=dev,
                         attention_backend="triton")
    tables = [runner.pool.allocator.alloc(2) for _ in range(3)]
    batch = ForwardBatch.build(runner.pool, [([7], 5, t) for t in tables])
    inp = DecodeGraphInputs(max_bs=4, max_pages=8, page_size=4, device=dev)
    inp.fill(batch, 4)
    guard = CaptureGuard()
    with guard:
        out = model(inp.batch(4), runner.attn)
    assert guard.bad == []
    assert guard.ours > 50  # embedding, norms, projections, rope, attention of every layer
    assert out.shape == (4, model.config.vocab_size)
