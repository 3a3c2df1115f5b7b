#!/usr/bin/env bash
# Runs a command next to a real mooncake_master inside a private network namespace.
# Usage: unshare -n mooncake_netns.sh PYTHON SCRIPT [ARGS...]
# Mooncake's master and clients bind every interface; inside `unshare -n` only loopback
# exists, so nothing listens beyond this machine. The master is stopped on exit.
set -u
PY="$1"; shift
ip link set lo up
MC_DIR=$("$PY" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')
LOG=${MOONCAKE_LOG:-$(mktemp -t mooncake_master.XXXXXX.log)}
"$MC_DIR/mooncake_master" --rpc_address=127.0.0.1 --rpc_port=50051 \
  --metrics_host=127.0.0.1 --metrics_port=9003 --default_kv_lease_ttl=1000 --logtostderr >"$LOG" 2>&1 &
MPID=$!
trap 'kill $MPID 2>/dev/null; wait $MPID 2>/dev/null' EXIT
for _ in $(seq 1 100); do
  (exec 3<>/dev/tcp/127.0.0.1/50051) 2>/dev/null && break
  sleep 0.1
done
"$PY" "$@"
