#!/usr/bin/env bash
# GPU check (issues 12, 29, 30): on one GPU, within 8 minutes (GPU_CHECK_BUDGET_S, default 480),
# from a fresh copy of the repository with only torch, transformers, safetensors, tokenizers,
# numpy, msgpack, triton and pytest installed (plus .gpu-wheels/ when carried:
# scripts/gpu_wheels.sh):
#   tests:  every module with a `gpu`-marked test, in one process; then every other test with
#           CUDA present, in parallel (pytest-xdist), summarised in $OUT/suites_summary.txt;
#   bench:  bench_transfer, bench_ttft_tiers and bench_engine at Llama-3.1-8B shape (dummy
#           weights, bf16, 8k and 32k prompts) and at the earlier runs' size.
# JSON results and logs go to $OUT (default benchmarks/results/gpu_check).
#
#   scripts/gpu_check.sh                               # everything, on a CUDA machine
#   scripts/gpu_check.sh --part tests                  # the tests only (about 5 minutes)
#   scripts/gpu_check.sh --part bench --no-install     # the benchmarks only, a second call
#   scripts/gpu_check.sh --device cpu --quick --no-install   # dry run of the script on CPU
#
# Without pytest installed (or with GPU_CHECK_STANDIN=1), the gpu tests run through a minimal
# stand-in (the Python runner below): each test function marked `gpu` (GPU_CHECK_MARK),
# parametrizations expanded, fixtures of the module and its conftest.py files resolved;
# tests/engine/test_cuda_graph_gpu_check.py checks it on CPU.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=cuda
QUICK=0
INSTALL=1
PART=all  # all | tests (gpu tests + suites) | bench (the benchmarks)
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    --part) PART=$2; shift 2 ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT"
export OUT PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false
# Unbuffered: a step killed at its time limit still leaves what it printed in its log.
export PYTHONUNBUFFERED=1
START=$(date +%s)
STATUS=0
BUDGET=${GPU_CHECK_BUDGET_S:-480}  # the whole check stays under 8 minutes
step() {  # step NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  local left=$(( BUDGET - (t0 - START) ))
  if [ "$left" -lt 20 ]; then
    echo "== $name: skipped (the ${BUDGET}s budget is spent)"; STATUS=1; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (limit ${limit}s)"
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: rc=$rc in $(( $(date +%s) - t0 ))s"
  [ $rc -eq 0 ] || STATUS=1
}

{
  date -u
  nvidia-smi 2>/dev/null || echo "no nvidia-smi"
  "$PY" -c "import torch, sys; print(sys.version); print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
  "$PY" -c "import triton; print('triton', triton.__version__)" 2>&1 || true
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if [ "$INSTALL" = 1 ]; then
  step install 60 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e .
  # The test suite's packages that the GPU machine lacks, carried with the tree
  # (scripts/gpu_wheels.sh makes .gpu-wheels/; the device tool's carry brings it).
  if ls .gpu-wheels/*.whl >/dev/null 2>&1; then
    step wheels 60 "$PY" -m pip install -q --no-deps --no-index .gpu-wheels/*.whl
  fi
fi

if [ "$PART" = all ] || [ "$PART" = tests ]; then
# -- the gpu tests ---------------------------------------------------------------------------
# Every test file with a `gpu`-marked test (they run here, one process, before the suites: the
# slowed-stream ordering tests want the GPU to themselves).
GPU_TESTS=$(grep -rl --include='test_*.py' 'mark.gpu' tests | sort | tr '\n' ' ')
if [ "${GPU_CHECK_STANDIN:-0}" != 1 ] && "$PY" -c "import pytest" 2>/dev/null; then
  # shellcheck disable=SC2086
  # -v: each test's name as it ends (a step cut at its limit shows where); -rfE: the failures
  # again at the end, within the log tail printed here; the ten slowest, to size the next run.
  step gpu_tests 120 "$PY" -m pytest -m gpu -v -rfE --durations=10 -p no:cacheprovider \
    -o addopts="" $GPU_TESTS
else
  # shellcheck disable=SC2086
  step gpu_tests 120 "$PY" - $GPU_TESTS <<'PYEOF'
"""Run the tests of the given files marked $GPU_CHECK_MARK (default `gpu`) without pytest: a
minimal stand-in for what those tests use (marks, parametrize and pytest.param, skip/skipif,
importorskip, raises, approx, fail; fixtures of the test module and of every conftest.py above
it, generator fixtures and scopes, autouse; the built-in tmp_path, tmp_path_factory and
monkeypatch). A test file that fails to import counts as a failure."""
import importlib, inspect, itertools, os, re, shutil, sys, tempfile, traceback, types
from pathlib import Path

MARK = os.environ.get("GPU_CHECK_MARK", "gpu")


class Skip(Exception):
    pass


class Failed(AssertionError):
    pass


class _Mark:
    def __init__(self, name, args=(), kwargs=None, configured=False):
        self.name, self.args, self.kwargs = name, args, kwargs or {}
        self.configured = configured

    def __call__(self, *args, **kwargs):
        bare = len(args) == 1 and callable(args[0]) and not kwargs
        if bare and (self.configured or self.name != "parametrize"):
            f = args[0]
            f.__dict__.setdefault("pytestmark", []).append(self)
            return f
        return _Mark(self.name, args, kwargs, configured=True)


class _MarkFactory:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Mark(name)


class _Param:
    def __init__(self, *values, marks=(), id=None):
        self.values, self.id = values, id
        self.marks = list(marks) if isinstance(marks, (list, tuple)) else [marks]


def _skip(reason="", allow_module_level=False):
    raise Skip(reason)


def _fail(reason="", pytrace=True):
    raise Failed(reason)


def _importorskip(modname, minversion=None, reason=None, **_):
    try:
        return importlib.import_module(modname)
    except ImportError as e:
        raise Skip(reason or f"could not import {modname!r}: {e}") from None


class _Raises:
    def __init__(self, exc, *args, match=None, **kwargs):
        self.exc, self.match = exc, match
        self.value = self.type = None
        if args:  # pytest.raises(Exc, func, *args, **kwargs)
            with self:
                args[0](*args[1:], **kwargs)

    def __enter__(self):
        return self

    def __exit__(self, t, v, tb):
        if t is None:
            raise Failed(f"DID NOT RAISE {self.exc}")
        if not issubclass(t, self.exc):
            return False
        if self.match is not None and not re.search(self.match, str(v)):
            raise Failed(f"{str(v)!r} does not match {self.match!r}")
        self.type, self.value = t, v
        return True


class _Approx:
    def __init__(self, expected, rel=None, abs=None, nan_ok=False):
        self.expected, self.rel, self.abs, self.nan_ok = expected, rel, abs, nan_ok

    def _close(self, got, exp):
        import math
        if isinstance(exp, (list, tuple)):
            return (isinstance(got, (list, tuple)) and len(got) == len(exp)
                    and all(self._close(g, e) for g, e in zip(got, exp)))
        if isinstance(exp, dict):
            return (isinstance(got, dict) and got.keys() == exp.keys()
                    and all(self._close(got[k], exp[k]) for k in exp))
        if hasattr(exp, "tolist") and not isinstance(exp, (int, float)):
            return self._close(got.tolist() if hasattr(got, "tolist") else got, exp.tolist())
        got, exp = float(got), float(exp)
        if math.isnan(exp):
            return self.nan_ok and math.isnan(got)
        if got == exp:
            return True
        if math.isinf(exp):
            return False
        rel = self.rel if self.rel is not None else (1e-6 if self.abs is None else 0.0)
        ab = self.abs if self.abs is not None else (1e-12 if self.rel is None else 0.0)
        return abs(got - exp) <= max(rel * abs(exp), ab)

    def __eq__(self, other):
        return self._close(other, self.expected)

    def __repr__(self):
        return f"approx({self.expected!r})"


_NOTSET = object()


class MonkeyPatch:
    def __init__(self):
        self._undo = []

    def setattr(self, target, name, value=_NOTSET, raising=True):
        if value is _NOTSET:  # setattr("pkg.mod.attr", value)
            value = name
            modname, _, name = target.rpartition(".")
            target = importlib.import_module(modname)
        old = (target.__dict__.get(name, _NOTSET) if inspect.isclass(target)
               else getattr(target, name, _NOTSET))
        if old is _NOTSET and raising:
            raise AttributeError(f"{target!r} has no attribute {name!r}")
        self._undo.append((target, name, old))
        setattr(target, name, value)

    def delattr(self, target, name=_NOTSET, raising=True):
        if name is _NOTSET:
            modname, _, name = target.rpartition(".")
            target = importlib.import_module(modname)
        if not hasattr(target, name):
            if raising:
                raise AttributeError(name)
            return
        old = (target.__dict__.get(name, _NOTSET) if inspect.isclass(target)
               else getattr(target, name))
        self._undo.append((target, name, old))
        delattr(target, name)

    def setitem(self, d, key, value):
        self._undo.append((d, key, d.get(key, _NOTSET), "item"))
        d[key] = value

    def delitem(self, d, key, raising=True):
        if key not in d:
            if raising:
                raise KeyError(key)
            return
        self._undo.append((d, key, d[key], "item"))
        del d[key]

    def setenv(self, name, value, prepend=None):
        value = str(value)
        if prepend and name in os.environ:
            value = value + prepend + os.environ[name]
        self.setitem(os.environ, name, value)

    def delenv(self, name, raising=True):
        self.delitem(os.environ, name, raising=raising)

    def syspath_prepend(self, path):
        self._undo.append((sys, "path", list(sys.path)))
        sys.path.insert(0, str(path))

    def chdir(self, path):
        self._undo.append(("cwd", os.getcwd()))
        os.chdir(path)

    def undo(self):
        for entry in reversed(self._undo):
            if entry[0] == "cwd":
                os.chdir(entry[1])
            elif len(entry) == 4:
                d, key, old, _ = entry
                if old is _NOTSET:
                    d.pop(key, None)
                else:
                    d[key] = old
            else:
                target, name, old = entry
                if old is _NOTSET:
                    if hasattr(target, name):
                        delattr(target, name)
                else:
                    setattr(target, name, old)
        self._undo.clear()


class TempPathFactory:
    def __init__(self):
        self._base = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self._n = 0

    def getbasetemp(self):
        return self._base

    def mktemp(self, basename, numbered=True):
        self._n += 1
        p = self._base / (f"{basename}{self._n}" if numbered else basename)
        p.mkdir(parents=True)
        return p


def _fixture(*args, scope="function", autouse=False, name=None, params=None, **_):
    def deco(f):
        f._standin_fixture = {"scope": scope, "autouse": autouse, "name": name or f.__name__}
        return f
    if args and callable(args[0]):
        return deco(args[0])
    return deco


pt = types.ModuleType("pytest")
pt.mark, pt.param, pt.fixture = _MarkFactory(), _Param, _fixture
pt.skip, pt.fail, pt.importorskip = _skip, _fail, _importorskip
pt.skip.Exception, pt.fail.Exception = Skip, Failed
pt.raises, pt.approx = _Raises, _Approx
pt.MonkeyPatch, pt.TempPathFactory = MonkeyPatch, TempPathFactory
pt.FixtureRequest = object
sys.modules["pytest"] = pt
sys.path.insert(0, os.getcwd())


def _modname(path):
    rel = os.path.relpath(os.path.abspath(path), os.getcwd())
    return rel[:-3].replace(os.sep, ".")


def _conftests(path):
    """conftest.py files from the repository root down to `path`'s folder (outermost first)."""
    root = Path(os.getcwd())
    d = Path(os.path.abspath(path)).parent
    chain = []
    while True:
        if (d / "conftest.py").is_file():
            chain.append(str(d / "conftest.py"))
        if d == root or d.parent == d:
            break
        d = d.parent
    return chain[::-1]


def _fixtures_of(namespace):
    return {f._standin_fixture["name"]: f for f in list(vars(namespace).values())
            if callable(f) and hasattr(f, "_standin_fixture")}


class Fixtures:
    def __init__(self):
        self.factory = TempPathFactory()
        self.cache = {}  # (fixture function, scope key) -> value
        self.finalizers = {"function": [], "module": [], "session": []}

    def _call(self, func, lookup, modname, stack):
        info = func._standin_fixture
        scope = {"package": "session", "class": "module"}.get(info["scope"], info["scope"])
        key = (func, modname if scope == "module" else None)
        if scope != "function" and key in self.cache:
            return self.cache[key]
        kwargs = self.resolve(func, lookup, modname, stack + (info["name"],))
        if inspect.isgeneratorfunction(func):
            gen = func(**kwargs)
            value = next(gen)
            self.finalizers[scope].append(lambda: next(gen, None))
        else:
            value = func(**kwargs)
        if scope != "function":
            self.cache[key] = value
        return value

    def get(self, name, lookup, modname, stack=()):
        if name in stack:
            raise RuntimeError(f"fixture cycle: {stack + (name,)}")
        if name == "tmp_path_factory":
            return self.factory
        if name == "tmp_path":
            return self.factory.mktemp("tmp")
        if name == "monkeypatch":
            mp = MonkeyPatch()
            self.finalizers["function"].append(mp.undo)
            return mp
        for fixtures in lookup:
            if name in fixtures:
                return self._call(fixtures[name], lookup, modname, stack)
        raise LookupError(f"fixture {name!r} not found")

    def resolve(self, func, lookup, modname, stack=(), given=()):
        out = {}
        for p in inspect.signature(func).parameters.values():
            if p.name in given or p.default is not p.empty or p.kind in (p.VAR_POSITIONAL,
                                                                          p.VAR_KEYWORD):
                continue
            out[p.name] = self.get(p.name, lookup, modname, stack)
        return out

    def autouse(self, lookup, modname):
        for fixtures in reversed(lookup):  # outermost conftest first
            for name, f in fixtures.items():
                if f._standin_fixture["autouse"]:
                    self.get(name, lookup, modname)

    def finish(self, scope):
        fins, self.finalizers[scope] = self.finalizers[scope], []
        for fin in reversed(fins):
            try:
                fin()
            except Exception:
                traceback.print_exc()
        if scope == "module":
            self.cache = {k: v for k, v in self.cache.items() if k[1] is None}


def _marks(obj):
    m = getattr(obj, "pytestmark", [])
    return list(m) if isinstance(m, (list, tuple)) else [m]


def _cases(marks):
    """(kwargs, extra marks) per parametrization (the product of every parametrize mark)."""
    axes = []
    for m in marks:
        if m.name != "parametrize":
            continue
        argnames = m.args[0] if m.args else m.kwargs["argnames"]
        argvalues = m.args[1] if len(m.args) > 1 else m.kwargs["argvalues"]
        names = ([n.strip() for n in argnames.split(",") if n.strip()]
                 if isinstance(argnames, str) else list(argnames))
        axis = []
        for v in argvalues:
            extra = []
            if isinstance(v, _Param):
                extra, v = v.marks, (v.values if len(names) > 1 else v.values[0])
            vals = tuple(v) if len(names) > 1 else (v,)
            axis.append((dict(zip(names, vals)), extra))
        axes.append(axis)
    for combo in itertools.product(*axes):
        kwargs, extra = {}, []
        for kw, ex in combo:
            kwargs.update(kw)
            extra += ex
        yield kwargs, extra


def _skip_reason(marks):
    for m in marks:
        if m.name == "skip":
            return m.kwargs.get("reason", m.args[0] if m.args else "skip")
        if m.name == "skipif":
            cond = m.args[0] if m.args else m.kwargs.get("condition", False)
            if cond:
                return m.kwargs.get("reason", "skipif")
    return None


def main(paths):
    passed = failed = skipped = 0
    fx = Fixtures()
    for path in paths:  # every conftest first (tests/conftest.py sets up Triton's interpreter)
        for c in _conftests(path):
            try:
                importlib.import_module(_modname(c))
            except Exception:
                failed += 1
                print(f"FAILED {c}: cannot import")
                traceback.print_exc()
    for path in paths:
        modname = _modname(path)
        try:
            mod = importlib.import_module(modname)
        except Skip as e:
            skipped += 1
            print(f"SKIPPED {path}: {e}")
            continue
        except Exception:
            failed += 1
            print(f"FAILED {path}: cannot import")
            traceback.print_exc()
            continue
        lookup = [_fixtures_of(mod)] + [_fixtures_of(sys.modules[_modname(c)])
                                        for c in reversed(_conftests(path))
                                        if _modname(c) in sys.modules]
        module_marks = _marks(mod)
        for fname in sorted(vars(mod)):
            f = getattr(mod, fname)
            if not fname.startswith("test") or not inspect.isfunction(f):
                continue
            marks = module_marks + _marks(f)
            for kwargs, extra in _cases(marks):
                all_marks = marks + extra
                if not any(m.name == MARK for m in all_marks):
                    continue
                label = f"{path}::{fname}{kwargs if kwargs else ''}"
                reason = _skip_reason(all_marks)
                if reason is not None:
                    skipped += 1
                    print(f"SKIPPED {label}: {reason}")
                    continue
                try:
                    fx.autouse(lookup, modname)
                    f(**kwargs, **fx.resolve(f, lookup, modname, given=kwargs))
                except Skip as e:
                    skipped += 1
                    print(f"SKIPPED {label}: {e}")
                except BaseException as e:
                    if isinstance(e, KeyboardInterrupt):
                        raise
                    failed += 1
                    print(f"FAILED {label}")
                    traceback.print_exc()
                else:
                    passed += 1
                    print(f"PASSED {label}")
                finally:
                    fx.finish("function")
        fx.finish("module")
    fx.finish("session")
    shutil.rmtree(fx.factory.getbasetemp(), ignore_errors=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped")
    return 1 if failed else 0


sys.exit(main(sys.argv[1:]))
PYEOF
fi

# -- every suite with CUDA present -----------------------------------------------------------
# pytest-xdist workers share the GPU (each process sees HICACHE_GPU_SHARE of it through
# scripts/gpu_share/sitecustomize.py, so the engines' KV pools fit side by side); a per-test
# time limit; scripts/gpu_report.py writes each test's outcome as it ends, so a run cut at its
# limit still reports, and prints the summary: counts, each failure's id and first line, and why
# tests skipped. Tests needing what this machine cannot run (redis-server, Mooncake, LMCache,
# SGLang, smg) skip with their reason. The lint test (ruff, mypy: the same on any machine, and
# not carried) is left to CI.
SUITES=${GPU_CHECK_SUITES:-tests}
if [ "$QUICK" = 1 ]; then SUITES=${GPU_CHECK_SUITES:-tests/hicache}; fi
if "$PY" -c "import pytest, xdist, pytest_timeout" 2>/dev/null; then
  WORKERS=${GPU_CHECK_WORKERS:-12}
  : >"$OUT/suites.tsv"
  # shellcheck disable=SC2086
  GPU_REPORT="$OUT/suites.tsv" HICACHE_GPU_SHARE=${HICACHE_GPU_SHARE:-$(awk "BEGIN{print 0.9/$WORKERS}")} \
    PYTHONPATH="$ROOT/scripts/gpu_share:$ROOT/scripts:$PYTHONPATH" \
    step suites "${GPU_CHECK_SUITES_S:-200}" "$PY" -m pytest -p gpu_report -p no:cacheprovider \
    -n "$WORKERS" --timeout 240 -q -o addopts="--strict-markers" -rN -m "not gpu" \
    --deselect tests/hicache/test_lint.py $SUITES
  "$PY" scripts/gpu_report.py "$OUT/suites.tsv" | tee "$OUT/suites_summary.txt"
else
  echo "== suites: skipped (needs pytest, pytest-xdist and pytest-timeout: scripts/gpu_wheels.sh)"
  STATUS=1
fi

fi  # tests

if [ "$PART" = all ] || [ "$PART" = bench ]; then
# -- benchmarks ------------------------------------------------------------------------------
# Issue 30: a deployed model's shape, Llama-3.1-8B (the shipped config, engine/model_configs),
# with random weights made on the device (--load-format dummy: no checkpoint, no network), bf16,
# 8k and 32k prompts. The --quick dry run takes the same path on a tiny config.
if [ "$QUICK" = 1 ]; then
  TINY_CFG="$OUT/tiny_config"
  mkdir -p "$TINY_CFG"
  echo '{"model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "vocab_size": 1024, "max_position_embeddings": 4096}' >"$TINY_CFG/config.json"
  step bench_transfer 120 "$PY" benchmarks/bench_transfer.py --device "$DEVICE" --quick \
    --out "$OUT/bench_transfer.json"
  step bench_ttft_tiers_config 120 "$PY" benchmarks/bench_ttft_tiers.py --device "$DEVICE" \
    --model-config "$TINY_CFG/config.json" --load-format dummy --tokens 512 --page-size 16 \
    --repeats 1 --out "$OUT/bench_ttft_tiers_config.json"
  step bench_engine_config 120 "$PY" benchmarks/bench_engine.py --device "$DEVICE" \
    --model-config "$TINY_CFG/config.json" --load-format dummy --prompt-tokens 256,512 \
    --batch-prompts 2 --batch-prompt-tokens 64 --decode-batches 1,4 --decode-context 32 \
    --decode-steps 4 --repeats 1 --out "$OUT/bench_engine_config.json"
  step bench_ttft_tiers 240 "$PY" benchmarks/bench_ttft_tiers.py --device "$DEVICE" --quick \
    --repeats 1 --out "$OUT/bench_ttft_tiers.json"
else
  step bench_transfer 60 "$PY" benchmarks/bench_transfer.py --device "$DEVICE" \
    --out "$OUT/bench_transfer.json"
  L8B=(--device "$DEVICE" --model-config llama-3.1-8b --load-format dummy --dtype bfloat16)
  step bench_ttft_tiers_llama8b_8k 120 "$PY" benchmarks/bench_ttft_tiers.py "${L8B[@]}" \
    --tokens 8000 --repeats 2 --compute-repeats 2 --out "$OUT/bench_ttft_tiers_llama8b_8k.json"
  step bench_engine_llama8b 100 "$PY" benchmarks/bench_engine.py "${L8B[@]}" \
    --prompt-tokens 8192,32768 --decode-batches 1,16,64 --repeats 2 \
    --out "$OUT/bench_engine_llama8b.json"
  step bench_ttft_tiers_llama8b_32k 150 "$PY" benchmarks/bench_ttft_tiers.py "${L8B[@]}" \
    --tokens 32000 --repeats 1 --compute-repeats 1 \
    --out "$OUT/bench_ttft_tiers_llama8b_32k.json"
  # The earlier runs' size (2048 hidden, 16 layers, bf16, 8,000 tokens), for comparison.
  step bench_ttft_tiers 60 "$PY" benchmarks/bench_ttft_tiers.py --device "$DEVICE" \
    --hidden 2048 --layers 16 --tokens 8000 --vocab 32000 --dtype bfloat16 --repeats 2 \
    --compute-repeats 2 --out "$OUT/bench_ttft_tiers.json"
fi
if [ -f benchmarks/bench_engine.py ]; then
  HELP=$("$PY" benchmarks/bench_engine.py --help 2>&1 || true)
  ARGS=()
  case "$HELP" in *--device*) ARGS+=(--device "$DEVICE") ;; esac
  case "$HELP" in *--out*) ARGS+=(--out "$OUT/bench_engine.json") ;; esac
  if [ "$QUICK" = 1 ]; then case "$HELP" in *--quick*) ARGS+=(--quick) ;; esac; fi
  step bench_engine 50 "$PY" benchmarks/bench_engine.py "${ARGS[@]}"
fi
fi  # bench
echo "gpu_check: status $STATUS in $(( $(date +%s) - START ))s; results in $OUT"
ls -l "$OUT"
exit $STATUS
