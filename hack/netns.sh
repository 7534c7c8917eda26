#!/usr/bin/env bash
# Runs a command inside a fresh network namespace that has only loopback, unless already in one.
# NIXL's listen thread and UCX bind all interfaces; here "all" is just 127.0.0.1.
set -euo pipefail
if [ "$(ip -o link show | awk -F': ' '{print $2}')" = "lo" ]; then
  exec "$@"
fi
exec unshare -n -- bash -c 'ip link set lo up && exec "$@"' netns "$@"
