#!/usr/bin/env bash
# kvblend: a balanced deployment on one machine's loopback, as docs/DEPLOY.md
# draws it: a Redis Cluster of 3 primaries with a replica each, N `kvblend
# serve` on it, and HAProxy in front routing a request by its first document
# (the same documents meet the same server's chunk tiers).
#
#   scripts/deploy_local.sh start -m MODEL [--servers N] [--port P] [--base-port B]
#                           [--dir DIR] [--kvblend BIN] [-- SERVE_ARGS…]
#   scripts/deploy_local.sh stop DIR
#
# start returns once everything answers and leaves the processes running;
# DIR (a new temporary folder by default) holds their logs, the HAProxy
# config, `pids` (every process), `redis` and `servers` ("PORT PID" lines);
# stop kills them. Ports: Redis on B…B+5, the servers on
# B+10…, HAProxy on P (default 8080), its stats page on P+1.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
die() { echo "deploy_local: $*" >&2; exit 1; }

cmd="${1:-}"; shift || true
if [[ "$cmd" == stop ]]; then
  dir="${1:?usage: deploy_local.sh stop DIR}"
  [[ -f "$dir/pids" ]] || die "no $dir/pids"
  while read -r pid; do kill "$pid" 2>/dev/null || true; done <"$dir/pids"
  sleep 0.2
  while read -r pid; do kill -9 "$pid" 2>/dev/null || true; done <"$dir/pids"
  rm -f "$dir/pids"
  exit 0
fi
[[ "$cmd" == start ]] || die "usage: deploy_local.sh start -m MODEL [...] | stop DIR"

model="" servers=2 port=8080 base=17000 dir="" bin="$root/build/bin/kvblend"
while (($#)); do
  case "$1" in
    -m) model="$2"; shift 2 ;;
    --servers) servers="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --base-port) base="$2"; shift 2 ;;
    --dir) dir="$2"; shift 2 ;;
    --kvblend) bin="$2"; shift 2 ;;
    --) shift; break ;;
    *) die "unknown argument $1" ;;
  esac
done
serve_args=("$@")
[[ -n "$model" ]] || die "-m MODEL is required"
[[ "$servers" =~ ^[1-9][0-9]?$ ]] || die "--servers must be 1..99"
# Redis' cluster bus listens on each node's port + 10000
[[ "$base" =~ ^[0-9]+$ ]] && ((base > 0 && base + 10005 < 65536 && base + 10 + servers < 65536)) || die "bad --base-port $base"
[[ "$port" =~ ^[0-9]+$ ]] && ((port > 0 && port + 1 < 65536)) || die "bad --port $port"
[[ -x "$bin" ]] || die "no kvblend binary at $bin (build first, or --kvblend BIN)"
for tool in redis-server redis-cli haproxy curl; do
  command -v "$tool" >/dev/null || die "$tool not found: run scripts/setup.sh"
done
dir="${dir:-$(mktemp -d /tmp/kvblend-deploy.XXXXXX)}"
mkdir -p "$dir"
: >"$dir/pids"; : >"$dir/redis"; : >"$dir/servers"
# a start that fails stops what it started
trap 'bash "$0" stop "$dir" >/dev/null 2>&1 || true' EXIT

# wait up to $2 seconds for command $1 to succeed
wait_for() {
  local i
  for ((i = 0; i < $2 * 10; i++)); do eval "$1" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

# --- the Redis Cluster: 3 primaries, 3 replicas --------------------------------
nodes=()
for i in 0 1 2 3 4 5; do
  p=$((base + i))
  mkdir -p "$dir/redis-$p"
  redis-server --port "$p" --bind 127.0.0.1 --cluster-enabled yes --cluster-config-file nodes.conf \
    --cluster-node-timeout 1000 --save "" --appendonly no --dir "$dir/redis-$p" --logfile redis.log \
    >/dev/null 2>&1 </dev/null &
  echo $! >>"$dir/pids"
  echo "$p $!" >>"$dir/redis"
  nodes+=("127.0.0.1:$p")
done
for n in "${nodes[@]}"; do
  wait_for "redis-cli -h 127.0.0.1 -p ${n#*:} ping | grep -q PONG" 10 || die "redis on $n did not start"
done
redis-cli --cluster create "${nodes[@]}" --cluster-replicas 1 --cluster-yes >"$dir/cluster-create.log" 2>&1 ||
  die "redis-cli --cluster create failed: $dir/cluster-create.log"
for n in "${nodes[@]}"; do
  wait_for "redis-cli -h 127.0.0.1 -p ${n#*:} cluster info | grep -q cluster_state:ok" 30 ||
    die "the cluster did not come up on $n"
done
store="redis-cluster://${nodes[0]},${nodes[1]},${nodes[2]}"

# --- the kvblend servers ---------------------------------------------------------
server_lines=""
for ((i = 0; i < servers; i++)); do
  p=$((base + 10 + i))
  "$bin" serve -m "$model" --host 127.0.0.1 --port "$p" --store "$store" --quiet "${serve_args[@]}" \
    >"$dir/kvblend-$p.log" 2>&1 </dev/null &
  echo $! >>"$dir/pids"
  echo "$p $!" >>"$dir/servers"
  server_lines+="    server s$i 127.0.0.1:$p check inter 500 fall 2 rise 2"$'\n'
done
for ((i = 0; i < servers; i++)); do
  p=$((base + 10 + i))
  wait_for "curl -sf http://127.0.0.1:$p/health" 120 || die "kvblend on $p did not start: $dir/kvblend-$p.log"
done

# --- HAProxy: by the first document, else the least busy server -----------------
# the first document's id, else its text, else the document itself when it is
# a string: a request's documents meet the server whose tiers hold them. a
# request without documents (a plain prompt) goes to the least busy server.
# a server that fails its /health check twice is taken out; a request whose
# connection to it fails is sent to another one (redispatch)
cat >"$dir/haproxy.cfg" <<EOF
global
    maxconn 2048
    # a request body is read whole (routing, retries) when it fits a buffer:
    # larger ones are served too, by the least busy server and never retried
    tune.bufsize 131072
defaults
    mode http
    timeout connect 2s
    timeout client 600s
    timeout server 600s
    timeout http-request 30s
    option redispatch
    retries 2
    retry-on conn-failure empty-response
frontend kvblend
    bind 127.0.0.1:$port
    option http-buffer-request
    http-request set-var(txn.docs) req.body,json_query('\$.documents[0].id')
    http-request set-var(txn.docs) req.body,json_query('\$.documents[0].text') unless { var(txn.docs) -m found }
    http-request set-var(txn.docs) req.body,json_query('\$.documents[0]') unless { var(txn.docs) -m found }
    use_backend by_documents if { var(txn.docs) -m found }
    default_backend least_busy
frontend stats
    bind 127.0.0.1:$((port + 1))
    stats enable
    stats uri /
backend by_documents
    balance hash var(txn.docs)
    hash-type consistent
    option httpchk GET /health
${server_lines}backend least_busy
    balance leastconn
    option httpchk GET /health
${server_lines}
EOF
haproxy -c -f "$dir/haproxy.cfg" >"$dir/haproxy-check.log" 2>&1 || die "bad HAProxy config: $dir/haproxy-check.log"
haproxy -db -f "$dir/haproxy.cfg" >"$dir/haproxy.log" 2>&1 </dev/null &
echo $! >>"$dir/pids"
wait_for "curl -sf http://127.0.0.1:$port/health" 20 || die "HAProxy on $port did not answer: $dir/haproxy.log"

trap - EXIT
echo "deploy_local: http://127.0.0.1:$port/v1 ($servers servers on $store); state in $dir"
echo "deploy_local: stop with: $0 stop $dir"
