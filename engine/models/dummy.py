"""`--load-format dummy`: a model built from `config.json` alone, with random weights made on
the device (no checkpoint file), as SGLang's and vLLM's `dummy` load format does.

Each parameter is drawn from its own generator, seeded by the seed and the parameter's name:
normal(0, 0.02) like an initialisation, norms at 1, biases at 0, so activations stay finite at
any depth. The same seed gives the same weights on the same kind of device (CPU and CUDA draw
different streams) and, under tensor parallelism, the same replicated parameters on every rank.

`engine/model_configs/<name>/config.json` ships the published configs of models people deploy
(no weights), so that benchmarks run at their real shapes on a machine with no network:
`--model-path llama-3.1-8b --load-format dummy`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from engine.models.parallel import TPModel

SHIPPED_CONFIGS_DIR = Path(__file__).resolve().parents[1] / "model_configs"
INIT_STD = 0.02
_TAG = b"hicache/model/dummy/v1\0"


def shipped_configs() -> list[str]:
    """Names of the shipped configs (`llama-3.1-8b`, ...)."""
    return sorted(p.parent.name for p in SHIPPED_CONFIGS_DIR.glob("*/config.json"))


def shipped_config_dir(name: str) -> Path | None:
    """The directory of shipped config `name` (case-insensitive), or None."""
    d = SHIPPED_CONFIGS_DIR / name.lower()
    return d if name and (d / "config.json").is_file() else None


def param_seed(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}\0{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@torch.no_grad()
def init_dummy_weights(model: TPModel, seed: int = 0) -> None:
    """Fill every parameter of `model` in place on its device (nothing on `meta`)."""
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            continue
        if name.endswith("bias"):
            p.zero_()
        elif p.dim() == 1 and name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            g = torch.Generator(device=p.device).manual_seed(param_seed(seed, name))
            p.normal_(0.0, INIT_STD, generator=g)


def dummy_fingerprint(path: str | Path, seed: int, device: torch.device) -> str:
    """Names the KV of a dummy model: its config.json, the seed and the kind of device whose
    random stream drew the weights (`--model-id` overrides it)."""
    h = hashlib.sha256(_TAG)
    h.update((Path(path) / "config.json").read_bytes())
    h.update(f"\0seed={seed}\0device={device.type}".encode())
    return h.hexdigest()


def config_dir_of(spec: str | Path) -> Path:
    """The directory of a model config named by `spec`: a shipped config's name, a directory
    holding config.json, or a config.json file (benchmarks' `--model-config`)."""
    p = Path(spec)
    if p.is_file():
        return p.parent
    if (p / "config.json").is_file():
        return p
    shipped = shipped_config_dir(str(spec))
    if shipped is None:
        raise FileNotFoundError(f"no model config {spec!r}: not a config.json, a directory "
                                f"holding one, or a shipped config ({', '.join(shipped_configs())})")
    return shipped
