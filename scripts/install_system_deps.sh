#!/usr/bin/env bash
# Installs the Debian packages the tests need, when they are missing (needs root or sudo).
#   redis-server  - the `redis` backend's tests start real servers
#   libibverbs1   - loaded by Mooncake's transfer engine, even over TCP
#   iproute2      - `ip` to bring up loopback in the network namespace Mooncake's tests use
#   prometheus    - a real scraper that evaluates the Grafana dashboard's queries (deploy/grafana)
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1' || need+=(libibverbs1)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v unshare >/dev/null 2>&1 || need+=(util-linux)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install_system_deps: need root to install: ${need[*]}" >&2; exit 1; fi
fi
echo "install_system_deps: installing ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
