"""For scripts/gpu_check.sh only: many test processes share one GPU.

With `HICACHE_GPU_SHARE=<fraction>` set and this directory on PYTHONPATH, every Python process
(pytest-xdist workers, the engine servers and tensor-parallel ranks they start) sees
`torch.cuda.mem_get_info` report at most that fraction of the device, less what the process has
reserved already. An engine sizes its KV pool from that (`mem_fraction_static` of the free
memory), so a dozen engines fit side by side instead of the first one taking half the GPU.
torch is imported only when the variable is set, and CUDA is not initialised here.
"""

import os

_share = float(os.environ.get("HICACHE_GPU_SHARE", "0") or 0)
if _share > 0:
    try:
        import torch
    except ImportError:  # pragma: no cover - a process without torch
        torch = None
    if torch is not None:
        _real = torch.cuda.mem_get_info

        def _mem_get_info(device=None):  # type: ignore[no-untyped-def]
            free, total = _real(device)
            cap = int(total * _share) - torch.cuda.memory_reserved(device)
            return max(0, min(free, cap)), total

        torch.cuda.mem_get_info = _mem_get_info
        torch.cuda.memory.mem_get_info = _mem_get_info
