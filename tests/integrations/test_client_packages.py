"""The thin client distribution `hicache-client` (clients/hicache-client, docs/sglang.md).

- its one import package, `hicache_client`, imports nothing of ours outside it, and no third-party package it does not declare
  (torch, sglang and lmcache only in the plugins, which run inside those engines);
- its wheel and the main distribution's have no file in common (both can be installed);
- installed with --no-deps in a fresh venv (only pyzmq, msgpack, xxhash, zstandard
  and numpy beside it), the wire
  client and the codec import without torch and store pages in a real `hicache-server`; the two
  plugins import there once an engine's packages (torch, sglang, lmcache) are on the path;
- (network) pip resolves it together with `sglang==0.5.23`, and with `vllm` + `lmcache==0.5.6`,
  to exactly what those engines resolve to alone, plus hicache-client.

The resolve runs pip's metadata-only dry run (`--dry-run --report`, `--use-feature=fast-deps`:
wheel metadata read by HTTP range requests, so no GPU wheel is downloaded even from an index that
does not serve PEP 658 metadata) with `PIP_CONFIG_FILE=/dev/null` (a site pip.conf may cap torch
to the wheels on one machine's disk). It needs PyPI: `make test` runs inside a loopback-only
network namespace, where it skips; `make client-check` runs this module outside it. Measured
here: one resolve takes 65-75 s alone (sglang / vllm) and 2-2.5 min with the others running
(the module: 5 min on 2 shared cores); without fast-deps this machine's index (no PEP 658
metadata) made pip download 4.7 GB of wheels, CUDA torch included, for the sglang resolve alone.
"""

from __future__ import annotations

import ast
import concurrent.futures
import importlib.util
import json
import os
import random
import shutil
import ssl
import subprocess
import sys
import sysconfig
import textwrap
import time
import urllib.error
import urllib.request
import venv
import zipfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import tomllib

from hicache_client.backend import StorageConfig
from hicache_client.codec import PageCodec
from hicache_client.remote.backend import HiCacheServerBackend
from tests.storage_backends.hicache_server_proc import hicache_server

REPO = Path(__file__).resolve().parents[2]
CLIENT_DIR = REPO / "clients" / "hicache-client"
OURS = ("hicache", "hicache_client", "storage_backends", "integrations", "engine", "tools")
# Third-party imports a client module may make: its declared dependencies everywhere; the host
# engine's packages in the plugin that runs inside it.
DIST_OF = {"zmq": "pyzmq", "msgpack": "msgpack", "xxhash": "xxhash", "zstandard": "zstandard",
           "numpy": "numpy"}
# Imports only a module behind an extra makes (hicache-client[encryption]: hicache_client.remote.seal,
# hicache_client.remote.identity).
EXTRA_OF = {"cryptography": "cryptography"}
# The lossy KV compressions (fp8, int4) run on torch, imported when one is built, inside an engine.
ENGINE_IMPORTS = {"hicache_client.compression": {"torch"},
                  "hicache_client.sglang": {"torch", "sglang"},
                  "hicache_client.lmcache": {"torch", "lmcache"}}


def client_modules() -> list[str]:
    """Dotted names of every module the client ships: the whole `hicache_client` package."""
    out = []
    for path in sorted((REPO / "hicache_client").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        name = ".".join(path.relative_to(REPO).with_suffix("").parts)
        out.append(name.removesuffix(".__init__"))
    return out


def _runtime_imports(path: Path) -> set[str]:
    """Every module `path` imports when run (function-level imports included, imports under
    `if TYPE_CHECKING:` not)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for orelse in node.orelse:
                visit(orelse)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _source(module: str) -> Path | None:
    base = REPO / module.replace(".", "/")
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").exists() else None


def test_client_modules_import_only_the_client_and_declared_packages() -> None:
    shipped = set(client_modules())
    deps = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"]["dependencies"]
    declared = {d.split(">")[0].split("=")[0].split("[")[0].strip() for d in deps}
    assert declared == set(DIST_OF.values()), "update DIST_OF with the client's dependencies"
    extras = tomllib.loads((CLIENT_DIR / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["encryption"]
    assert {d.split(">")[0].strip() for d in extras} == set(EXTRA_OF.values())
    problems = []
    for mod in sorted(shipped):
        src = _source(mod)
        assert src is not None, mod
        engine = next((v for k, v in ENGINE_IMPORTS.items() if mod.startswith(k)), set())
        for name in sorted(_runtime_imports(src)):
            top = name.split(".")[0]
            if top in OURS:
                if top != "hicache_client":
                    problems.append(f"{mod} imports {name}, outside hicache_client")
            elif top in sys.stdlib_module_names or top == "__future__":
                continue
            elif top not in DIST_OF and top not in engine and top not in EXTRA_OF:
                problems.append(f"{mod} imports {top}, not a dependency of hicache-client")
    assert problems == []


# --------------------------------------------------------------------------------------------
# The wheels
# --------------------------------------------------------------------------------------------


def _build_wheel(project: Path, out: Path) -> Path:
    # setuptools packages whatever its build/lib holds: a module dropped from the list would
    # linger from an earlier build.
    shutil.rmtree(project / "build", ignore_errors=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "-w", str(out), str(project)],
        check=True, capture_output=True, text=True, cwd=REPO,
    )
    (wheel,) = out.glob("*.whl")
    return wheel


@pytest.fixture(scope="module")
def client_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_wheel(CLIENT_DIR, tmp_path_factory.mktemp("client-wheel"))


def _py_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if n.endswith(".py")}


def test_client_and_main_wheels_share_no_file(
    client_wheel: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    main_wheel = _build_wheel(REPO, tmp_path_factory.mktemp("main-wheel"))
    client, main = _py_files(client_wheel), _py_files(main_wheel)
    assert client == {str((_source(m) or REPO).relative_to(REPO)) for m in client_modules()}
    assert client & main == set()
    # One import package each: the client's top_level.txt names only hicache_client.
    with zipfile.ZipFile(client_wheel) as z:
        top_level = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/top_level.txt")))
        entry_points = z.read(next(n for n in z.namelist()
                                   if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert top_level.split() == [b"hicache_client"]
    assert "hicache = hicache_client.remote.backend:HiCacheServerBackend" in entry_points
    assert {p.split("/")[0] for p in main} == {
        "hicache", "engine", "storage_backends", "tools", "integrations"}
    with zipfile.ZipFile(main_wheel) as z:
        meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA")))
    assert b"Requires-Dist: hicache-client==0.1.0" in meta
    # Together they hold every module of the tree's packages (none lost by the split).
    tree = {
        str(p.relative_to(REPO))
        for top in ("hicache", "hicache_client", "engine", "storage_backends", "tools",
                    "integrations")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts and (p.parent / "__init__.py").exists()
    }
    assert client | main == tree


# --------------------------------------------------------------------------------------------
# A fresh venv with the client alone
# --------------------------------------------------------------------------------------------


def _link_dist(name: str, site: Path) -> None:
    """Put distribution `name` from this environment into `site` (its files, by symlink)."""
    dist = metadata.distribution(name)
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    for top in tops:
        src = Path(str(dist.locate_file(top)))
        if src.exists() and not (site / top).exists():
            (site / top).symlink_to(src)


@dataclass(frozen=True)
class Venv:
    python: Path
    site: Path  # its site-packages


@pytest.fixture(scope="module")
def client_venv(client_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("client-venv")
    venv.EnvBuilder(with_pip=False).create(root)
    py = root / "bin" / "python"
    site = Path(subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    # This environment's pip installs into the new one (no network: --no-deps, a local wheel).
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
         "--target", str(site), str(client_wheel)],
        check=True, capture_output=True, text=True,
    )
    for dep in DIST_OF.values():
        _link_dist(dep, site)
    return Venv(py, site)


def _run(v: Venv, code: str) -> dict[str, Any]:
    """Run `code` isolated (-I: no cwd, no PYTHONPATH) in the venv; it prints one JSON line."""
    full_env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
    r = subprocess.run([str(v.python), "-I", "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=full_env, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


NAMESPACE = bytes(range(32))
CODEC = dict(namespace=NAMESPACE, dtype="uint8", shape=(4000,), layout="raw",
             tokens_per_page=16, itemsize=1)


def _records(n: int) -> tuple[list[str], list[bytearray]]:
    c = PageCodec(**CODEC)  # type: ignore[arg-type]
    keys = [f"{i:064x}" for i in range(1, n + 1)]
    return keys, [c.encode(k, random.Random(k).randbytes(c.payload_bytes)) for k in keys]


def test_client_alone_imports_without_torch_and_talks_to_a_server(
    client_venv: Venv, tmp_path: Path
) -> None:
    code = f"""
        import json, random, sys
        from hicache_client.codec import PageCodec
        from hicache_client.backend import StorageConfig
        from hicache_client.remote.backend import HiCacheServerBackend
        import hicache_client.lmcache.settings, hicache_client.lmcache.records
        c = PageCodec(**{CODEC!r})
        keys = [f"{{i:064x}}" for i in range(1, 9)]
        recs = [c.encode(k, random.Random(k).randbytes(c.payload_bytes)) for k in keys]
        b = HiCacheServerBackend(StorageConfig(extra={{"url": sys.argv[1] if len(sys.argv) > 1
                                 else URL}}, namespace=c.namespace.hex()))
        stored = b.batch_set(keys[:4], [memoryview(r) for r in recs[:4]])
        out = [memoryview(bytearray(len(r))) for r in recs]
        got = b.batch_get(keys, out)
        same = [bytes(o) == bytes(r) for o, r in zip(out, recs)]
        b.close()
        failed = []
        for m in ("hicache_client.sglang", "hicache_client.lmcache.adapter"):
            try:
                __import__(m)
            except ImportError as e:
                failed.append([m, e.name])
        print(json.dumps(dict(
            stored=stored, got=got, same=same[:4], failed=failed,
            loaded=sorted(k for k in ("torch", "numpy", "xgrammar", "sglang", "lmcache", "engine")
                          if k in sys.modules),
            files=sorted({{m.split(".")[0]: getattr(sys.modules[m], "__file__", "") or ""
                           for m in sys.modules if m.split(".")[0] in
                           ("hicache", "hicache_client", "storage_backends", "integrations")
                           }}.values()))))
    """
    with hicache_server(tmp_path, capacity="64MiB") as srv:
        out = _run(client_venv, code.replace("URL", repr(srv.url)))
        # The pages it wrote are what this environment's client (the main tree) reads.
        keys, recs = _records(8)
        main_client = HiCacheServerBackend(
            StorageConfig(extra={"url": srv.url}, namespace=NAMESPACE.hex()))
        try:
            bufs = [memoryview(bytearray(len(r))) for r in recs]
            assert main_client.batch_get(keys, bufs) == [True] * 4 + [False] * 4
            assert [bytes(b) for b in bufs[:4]] == [bytes(r) for r in recs[:4]]
        finally:
            main_client.close()
    assert out["stored"] == [True] * 4
    assert out["got"] == [True] * 4 + [False] * 4
    assert out["same"] == [True] * 4
    assert out["loaded"] == []
    # Without an engine the plugins stop at exactly the engine's packages.
    assert out["failed"] == [["hicache_client.sglang", "torch"],
                             ["hicache_client.lmcache.adapter", "lmcache"]]
    assert all(f.startswith(str(client_venv.site)) for f in out["files"]), out["files"]


def _engine_skip_reason() -> str | None:
    for name in ("torch", "sglang", "lmcache"):
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed here (make setup installs it)"
    return None


@pytest.mark.sglang
@pytest.mark.lmcache
def test_both_plugins_import_from_the_client_beside_an_engine(client_venv: Venv) -> None:
    reason = _engine_skip_reason()
    if reason:
        pytest.skip(reason)
    # The engine's packages (torch, sglang, lmcache) from this environment, after the venv's own
    # site-packages: `hicache_client` still comes from the wheel.
    pth = client_venv.site / "engine-env.pth"
    pth.write_text(sysconfig.get_paths()["purelib"] + "\n")
    try:
        out = _run(client_venv, """
            import json, sys
            from hicache_client.sglang import HiCacheServerStorage
            from hicache_client.lmcache.adapter import HiCacheConnectorAdapter
            from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
            from lmcache.v1.storage_backend.connector import ConnectorAdapter
            print(json.dumps(dict(
                sglang=issubclass(HiCacheServerStorage, HiCacheStorage),
                lmcache=issubclass(HiCacheConnectorAdapter, ConnectorAdapter),
                files=sorted({sys.modules[m].__file__ for m in sys.modules
                              if m.split(".")[0] in ("hicache", "hicache_client",
                                                     "storage_backends", "integrations")}),
                engine="engine" in sys.modules)))
        """)
    finally:
        pth.unlink()
    assert out["sglang"] is True and out["lmcache"] is True
    assert out["engine"] is False
    assert all(f.startswith(str(client_venv.site)) for f in out["files"]), out["files"]


# --------------------------------------------------------------------------------------------
# Resolving beside the engines (network)
# --------------------------------------------------------------------------------------------


def _pypi_reason() -> str | None:
    try:
        ctx = ssl.create_default_context(cafile=os.environ.get("PIP_CERT") or None)
        urllib.request.urlopen("https://pypi.org/simple/hicache-client-probe/", timeout=10,
                               context=ctx).close()
    except urllib.error.HTTPError:
        return None  # PyPI answered (404: no such project)
    except OSError as e:
        where = (" (inside the loopback-only test namespace: run `make client-check`)"
                 if os.environ.get("HICACHE_IN_NETNS") == "1" else "")
        return f"PyPI is unreachable{where}: {e}"
    return None


def resolve(requirements: list[str], report: Path) -> tuple[dict[str, str] | None, str, float]:
    """pip's resolution of `requirements` for this interpreter, downloading metadata only:
    ({name: version} or None when it fails, pip's stderr and log, seconds)."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PIP_FIND_LINKS", "PIP_CONSTRAINT", "PIP_NO_INDEX", "PIP_CONFIG_FILE")}
    env["PIP_CONFIG_FILE"] = os.devnull
    log = report.with_suffix(".log")
    t = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q",
         "--use-feature=fast-deps", "--report", str(report), "--log", str(log), *requirements],
        capture_output=True, text=True, env=env,
    )
    took = time.monotonic() - t
    if r.returncode != 0:
        return None, r.stderr, took
    downloads = [line for line in log.read_text().splitlines() if " Downloading " in line]
    inst = json.loads(report.read_text())["install"]
    return ({i["metadata"]["name"].lower(): i["metadata"]["version"] for i in inst},
            "\n".join(downloads), took)


ENGINES = {
    "sglang": (["sglang==0.5.23"], {"sglang": "0.5.23"}),
    # vllm pinned to the release that resolved with lmcache 0.5.6 on 2026-12-04 (torch 2.14.0):
    # a later vllm must not turn this test red on its own.
    "lmcache": (["vllm==0.33.0", "lmcache==0.5.6"], {"lmcache": "0.5.6", "vllm": "0.33.0"}),
}


@pytest.mark.slow
@pytest.mark.network
@pytest.mark.parametrize("extra", sorted(ENGINES))
def test_client_resolves_beside_the_engine_and_moves_nothing(
    extra: str, client_wheel: Path, tmp_path: Path
) -> None:
    reason = _pypi_reason()
    if reason:
        pytest.skip(reason)
    engine, pinned = ENGINES[extra]
    client = f"hicache-client[{extra}] @ {client_wheel.as_uri()}"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        alone_f = pool.submit(resolve, engine, tmp_path / "alone.json")
        both_f = pool.submit(resolve, [client, *engine], tmp_path / "both.json")
        (alone, err_a, t_a), (both, err_b, t_b) = alone_f.result(), both_f.result()
    assert alone is not None, err_a[-4000:]
    assert both is not None, err_b[-4000:]
    print(f"resolve {extra}: engine alone {t_a:.0f} s, with hicache-client {t_b:.0f} s, "
          f"{len(both)} packages")
    for name, version in pinned.items():
        assert both[name] == version
    assert both["hicache-client"] == "0.1.0"
    assert "hicache" not in both
    # The engine's own resolution, every version as it was, plus the client and those of its
    # three dependencies the engine does not already require; nothing else.
    assert {k: both.get(k) for k in alone} == alone
    assert {"hicache-client"} <= set(both) - set(alone) <= {"hicache-client", *DIST_OF.values()}
    # No whole wheel was fetched to read metadata (fast-deps reads it by range requests).
    assert err_a == "" and err_b == ""
