"""Which source files the thin client distribution ships: one list, read by both builds.

The repository builds two distributions from one source tree, with no copied files:

- ``hicache-client`` (clients/hicache-client/pyproject.toml): the wire client of
  ``hicache-server``, the page record codec and the SGLang / LMCache plugins; it needs only
  pyzmq, msgpack and xxhash, so it installs beside an engine's own pins (torch, xgrammar, ...).
- ``hicache`` (pyproject.toml): everything else (the core, the engine, the other backends, the
  server, the tools); it requires ``hicache-client``, so an environment with both has each file
  from exactly one of them.

``ClientBuildPy`` keeps the modules named here, ``MainBuildPy`` drops them. Package
``__init__`` modules of the split packages ship in the client (the main distribution's modules
live in the same package directories). tests/integrations/test_client_packages.py checks that
these modules import nothing outside the list.
"""

from __future__ import annotations

from setuptools.command.build_py import build_py

# package -> its modules in the client; None: the whole package.
CLIENT_MODULES: dict[str, tuple[str, ...] | None] = {
    "hicache": (
        "__init__", "errors", "codec", "backend", "backoff", "units", "keys", "storage",
        "registry",
    ),
    "storage_backends": (
        "__init__", "common", "hicache_backend", "hicache_conn", "hicache_identity", "hicache_seal",
        "hicache_shm", "hicache_store",
    ),
    "storage_backends.server": (
        "__init__", "admin_protocol", "arena", "malloc", "protocol", "shm", "wire",
    ),
    "integrations": None,
    "integrations.sglang": None,
    "integrations.lmcache": None,
}


def in_client(package: str, module: str) -> bool:
    if package not in CLIENT_MODULES:
        return False
    modules = CLIENT_MODULES[package]
    return modules is None or module in modules


class ClientBuildPy(build_py):
    """build_py of ``hicache-client``: only the client's modules of each package."""

    def find_package_modules(self, package, package_dir):  # type: ignore[no-untyped-def]
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if in_client(m[0], m[1])]


class MainBuildPy(build_py):
    """build_py of ``hicache``: every module but the client's (those come from hicache-client)."""

    def find_package_modules(self, package, package_dir):  # type: ignore[no-untyped-def]
        found = super().find_package_modules(package, package_dir)
        return [m for m in found if not in_client(m[0], m[1])]
