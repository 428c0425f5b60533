#!/usr/bin/env bash
# Runs a command inside a fresh network namespace that has only loopback, when we can make one
# (root, util-linux `unshare`, iproute2 `ip`). Every server the tests start binds loopback, and
# Mooncake's master and clients listen on every interface whatever they are told: inside this
# namespace "every interface" is loopback alone. HICACHE_NO_NETNS=1 runs the command as is.
set -euo pipefail
if [ "${HICACHE_NO_NETNS:-0}" != "1" ] && [ "${HICACHE_IN_NETNS:-0}" != "1" ] \
   && command -v unshare >/dev/null 2>&1 && command -v ip >/dev/null 2>&1 \
   && unshare --net --fork true 2>/dev/null; then
  export HICACHE_IN_NETNS=1
  exec unshare --net --fork bash -c 'ip link set lo up && exec "$@"' in_netns "$@"
fi
exec "$@"
