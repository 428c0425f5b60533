#!/usr/bin/env bash
# Two hicache-engine instances sharing one hicache-server (the L3 tier), all on loopback.
#
# Engine A serves a long prompt and writes its KV pages through to the shared store, by itself
# (nothing asks A anything afterwards); engine B then serves the same prompt and takes the prefix
# from the store (a storage hit) instead of computing it, with the same greedy output.
#
#   scripts/two_engines_one_store.sh            # picks free ports, cleans up on exit
#   STORE_PORT=30100 A_PORT=30001 B_PORT=30002 scripts/two_engines_one_store.sh
#   KEEP_LOGS=1 scripts/two_engines_one_store.sh  # keep the three logs (the path is printed)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
STORE_PORT=${STORE_PORT:-$(free_port)}
A_PORT=${A_PORT:-$(free_port)}
B_PORT=${B_PORT:-$(free_port)}
WORK=$(mktemp -d -t hicache-two-engines.XXXXXX)
PIDS=()

cleanup() {
  local rc=$?
  if [ "$rc" != 0 ]; then
    for f in "$WORK"/*.log; do echo "---- $f (last lines)"; tail -n 30 "$f"; done
  fi
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  [ -n "${KEEP_LOGS:-}" ] && echo "logs kept in $WORK" || rm -rf "$WORK"
}
trap cleanup EXIT INT TERM

wait_for() {  # wait_for LOGFILE PATTERN PID
  for _ in $(seq 1 600); do
    grep -q "$2" "$1" && return 0
    kill -0 "$3" 2>/dev/null || { echo "process $3 died; its log:"; cat "$1"; return 1; }
    sleep 0.5
  done
  echo "timed out waiting for '$2' in $1"; return 1
}

echo "== hicache-server on 127.0.0.1:$STORE_PORT"
"$PY" -m storage_backends.server --host 127.0.0.1 --port "$STORE_PORT" --capacity 1GiB \
  >"$WORK/store.log" 2>&1 &
PIDS+=($!)
STORE_PID=$!
"$PY" - "$STORE_PORT" "$STORE_PID" <<'EOF'
import socket, sys, time, os
port, pid = int(sys.argv[1]), int(sys.argv[2])
for _ in range(600):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        sys.exit(0)
    except OSError:
        os.kill(pid, 0)
        time.sleep(0.1)
sys.exit("hicache-server did not start")
EOF

ENGINE_FLAGS=(
  --enable-hierarchical-cache
  --hicache-storage-backend hicache
  --hicache-storage-backend-extra-config "{\"url\": \"tcp://127.0.0.1:$STORE_PORT\"}"
  --hicache-storage-prefetch-policy wait_complete
  --max-total-tokens 32768
)
for name in A B; do
  port_var="${name}_PORT"
  echo "== engine $name on 127.0.0.1:${!port_var}"
  "$PY" -m engine --host 127.0.0.1 --port "${!port_var}" "${ENGINE_FLAGS[@]}" \
    >"$WORK/engine-$name.log" 2>&1 &
  PIDS+=($!)
  eval "PID_$name=$!"
done
wait_for "$WORK/engine-A.log" "hicache-engine ready" "$PID_A"
wait_for "$WORK/engine-B.log" "hicache-engine ready" "$PID_B"

"$PY" - "$A_PORT" "$B_PORT" "$STORE_PORT" <<'EOF'
import json, sys, time, urllib.request

from hicache_client.backend import StorageConfig
from hicache_client.remote.backend import HiCacheServerBackend

a, b = (f"http://127.0.0.1:{p}" for p in sys.argv[1:3])
store = HiCacheServerBackend(StorageConfig(extra={"url": f"tcp://127.0.0.1:{sys.argv[3]}"}))


def call(url, path, body=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


prompt = " ".join(f"Entry {i}: the tide table for pier {i % 7} lists high water at "
                  f"{i % 12} o'clock." for i in range(60))
body = {"text": prompt, "sampling_params": {"max_new_tokens": 16, "temperature": 0}}

out_a = call(a, "/generate", body)
print(f"A: {out_a['meta_info']['prompt_tokens']} prompt tokens, "
      f"cached {out_a['meta_info']['cached_tokens']}")
# A is left alone: its idle loop still sends the prompt's pages to the store. Watch the store.
page = 32
want = (out_a["meta_info"]["prompt_tokens"] + len(out_a["output_ids"]) - 1) // page
t0 = time.perf_counter()
for _ in range(600):
    pages = store.server_stats()["pages"]
    if pages >= want:
        break
    time.sleep(0.05)
print(f"store: {pages} pages from A, {time.perf_counter() - t0:.2f}s after A answered")

t0 = time.perf_counter()
out_b = call(b, "/generate", body)
dt = time.perf_counter() - t0
sb = call(b, "/hicache/stats")
print(f"B: {out_b['meta_info']['prompt_tokens']} prompt tokens, "
      f"cached {out_b['meta_info']['cached_tokens']} "
      f"(storage hit tokens {sb['storage_hit_tokens']}, {dt:.2f}s)")
same = out_a["output_ids"] == out_b["output_ids"]
print("A and B outputs identical:", same)
store.close()
if not (same and sb["storage_hit_tokens"] > 0):
    sys.exit("FAILED: B did not reuse A's prefix from the shared store")
print("OK: engine B served A's prefix from the shared L3 store")
EOF
