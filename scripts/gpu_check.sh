#!/usr/bin/env bash
# GPU check (issue 12, item 8): the `gpu`-marked tests, bench_transfer and bench_ttft_tiers at the
# GPU size (and benchmarks/bench_engine.py when present), in under 8 minutes on one GPU, from a
# fresh copy of the repository with only torch, transformers, safetensors, tokenizers, numpy,
# msgpack and triton installed. JSON results and logs go to $OUT (default
# benchmarks/results/gpu_check).
#
#   scripts/gpu_check.sh                               # on a CUDA machine
#   scripts/gpu_check.sh --device cpu --quick --no-install   # dry run of the script on CPU
#
# Without pytest installed, the gpu tests run through a minimal stand-in (scripts/gpu_check.sh's
# own runner below): each test function marked `gpu`, parametrizations expanded.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
DEVICE=cuda
QUICK=0
INSTALL=1
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --no-install) INSTALL=0; shift ;;
    *) echo "unknown argument $1" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-python3}
OUT=${OUT:-$ROOT/benchmarks/results/gpu_check}
mkdir -p "$OUT"
export OUT PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 LMCACHE_TRACK_USAGE=false
START=$(date +%s)
STATUS=0
BUDGET=${GPU_CHECK_BUDGET_S:-450}  # the whole check stays under 8 minutes
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
fi

# -- the gpu tests ---------------------------------------------------------------------------
GPU_TESTS="tests/hicache/test_transfer.py tests/hicache/test_roundtrip.py tests/hicache/test_transfer_layerwise.py"
for f in tests/engine/test_attention_*.py tests/engine/test_models.py; do
  [ -f "$f" ] && GPU_TESTS="$GPU_TESTS $f"
done
if "$PY" -c "import pytest" 2>/dev/null; then
  # shellcheck disable=SC2086
  step gpu_tests 120 "$PY" -m pytest -m gpu -q -p no:cacheprovider -o addopts="" $GPU_TESTS
else
  # shellcheck disable=SC2086
  step gpu_tests 120 "$PY" - $GPU_TESTS <<'PYEOF'
"""Run the `gpu`-marked tests of the given files without pytest (a minimal stand-in)."""
import importlib.util, itertools, sys, traceback, types

class Skip(Exception):
    pass

class _Mark:
    def __init__(self, name, args=(), kwargs=None, configured=False):
        self.name, self.args, self.kwargs = name, args, kwargs or {}
        self.configured = configured
    def __call__(self, *args, **kwargs):
        bare = len(args) == 1 and callable(args[0]) and not kwargs
        if bare and (self.configured or self.name != "parametrize"):
            f = args[0]
            f.__dict__.setdefault("marks", []).append(self)
            return f
        return _Mark(self.name, args, kwargs, configured=True)

class _MarkFactory:
    def __getattr__(self, name):
        return _Mark(name)

def _skip(reason=""):
    raise Skip(reason)

def _importorskip(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        raise Skip(f"no {name}")

class _Raises:
    def __init__(self, exc, match=None):
        self.exc = exc
    def __enter__(self):
        return self
    def __exit__(self, t, v, tb):
        if t is None:
            raise AssertionError(f"did not raise {self.exc}")
        return issubclass(t, self.exc)

def _approx(x, rel=1e-6, abs=1e-12):
    class A:
        def __eq__(self, o):
            return __builtins__.abs(o - x) <= max(rel * __builtins__.abs(x), abs)
    return A()

pt = types.ModuleType("pytest")
pt.mark, pt.skip, pt.importorskip, pt.raises, pt.approx = (
    _MarkFactory(), _skip, _importorskip, _Raises, _approx)
pt.fixture = lambda *a, **k: (a[0] if a and callable(a[0]) else (lambda f: f))
sys.modules["pytest"] = pt
sys.path.insert(0, ".")
passed = failed = skipped = 0
for path in sys.argv[1:]:
    name = path[:-3].replace("/", ".")
    try:
        mod = importlib.import_module(name)
    except Exception:
        print(f"SKIP {path}: cannot import"); traceback.print_exc(limit=1); continue
    for fname in dir(mod):
        f = getattr(mod, fname)
        marks = getattr(f, "marks", [])
        if not fname.startswith("test") or not any(m.name == "gpu" for m in marks):
            continue
        skip = [m for m in marks if m.name == "skipif" and m.args and m.args[0]]
        params = [m for m in marks if m.name == "parametrize"]
        names, values = [], []
        for m in params:
            argnames = [n.strip() for n in m.args[0].split(",")]
            names.append(argnames)
            values.append([v if len(argnames) > 1 else (v,) for v in m.args[1]])
        for combo in itertools.product(*values) if values else [()]:
            kwargs = {n: v for ns, vs in zip(names, combo) for n, v in zip(ns, vs)}
            label = f"{path}::{fname}{kwargs if kwargs else ''}"
            if skip:
                skipped += 1; print(f"SKIPPED {label}"); continue
            try:
                f(**kwargs)
            except Skip as e:
                skipped += 1; print(f"SKIPPED {label}: {e}")
            except Exception:
                failed += 1; print(f"FAILED {label}"); traceback.print_exc()
            else:
                passed += 1
print(f"{passed} passed, {failed} failed, {skipped} skipped")
sys.exit(1 if failed else 0)
PYEOF
fi

# -- benchmarks ------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then
  step bench_transfer 120 "$PY" benchmarks/bench_transfer.py --device "$DEVICE" --quick \
    --out "$OUT/bench_transfer.json"
  step bench_ttft_tiers 240 "$PY" benchmarks/bench_ttft_tiers.py --device "$DEVICE" --quick \
    --repeats 1 --out "$OUT/bench_ttft_tiers.json"
else
  step bench_transfer 60 "$PY" benchmarks/bench_transfer.py --device "$DEVICE" \
    --out "$OUT/bench_transfer.json"
  # The issue's GPU size: 2048 hidden, 16 layers, bf16, 8,000 tokens, page 64.
  step bench_ttft_tiers 160 "$PY" benchmarks/bench_ttft_tiers.py --device "$DEVICE" \
    --hidden 2048 --layers 16 --tokens 8000 --vocab 32000 --dtype bfloat16 --repeats 3 \
    --compute-repeats 2 \
    --out "$OUT/bench_ttft_tiers.json"
fi
if [ -f benchmarks/bench_engine.py ]; then
  HELP=$("$PY" benchmarks/bench_engine.py --help 2>&1 || true)
  ARGS=()
  case "$HELP" in *--device*) ARGS+=(--device "$DEVICE") ;; esac
  case "$HELP" in *--out*) ARGS+=(--out "$OUT/bench_engine.json") ;; esac
  if [ "$QUICK" = 1 ]; then case "$HELP" in *--quick*) ARGS+=(--quick) ;; esac; fi
  step bench_engine 80 "$PY" benchmarks/bench_engine.py "${ARGS[@]}"
fi
echo "gpu_check: status $STATUS in $(( $(date +%s) - START ))s; results in $OUT"
ls -l "$OUT"
exit $STATUS
