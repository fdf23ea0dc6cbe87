#!/usr/bin/env bash
# ZeRO across a real network link: two network namespaces joined by a veth
# pair stand for two hosts (wgrad-host0, wgrad-host1). mpirun runs in the
# first and starts its daemon in the second through a launch agent that
# does what ssh would (enter that namespace under that host name), and
# OpenMPI's TCP transport is restricted to the veth subnet, so every
# message between the ranks crosses the link and none goes through shared
# memory. Checks:
#  1. `wgrad train --distributed mpi --parallel zero --zero-stage 2` over the
#     two ranks ends at the single-device run's validation loss (relative 1e-3);
#  2. a run whose second namespace loses its link mid-run ends with an error
#     naming a rank and its host, instead of hanging (the collectives'
#     watchdog, WGRAD_TIMEOUT_S, if MPI itself waits forever).
# Needs root, iproute2 and util-linux (unshare), OpenMPI, and a wgrad built
# with `--features mpi` (first argument; default target/release/wgrad).
# Under ~2 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
WGRAD=$(realpath "${1:-target/release/wgrad}")

if [ "$(id -u)" != 0 ]; then
    echo "mpi-netns: needs root (network namespaces)" >&2
    exit 1
fi
if ! command -v ip >/dev/null 2>&1; then
    bash scripts/apt-install.sh mpi-netns iproute2 || { echo "mpi-netns: needs iproute2" >&2; exit 1; }
fi
for tool in mpirun unshare timeout; do
    command -v "$tool" >/dev/null 2>&1 || { echo "mpi-netns: needs $tool" >&2; exit 1; }
done

NS=(wgrad-net0 wgrad-net1)
HOSTS=(wgrad-host0 wgrad-host1)
IPS=(10.77.0.1 10.77.0.2)
VETH=(wgrad-veth0 wgrad-veth1)
remove_namespaces() {
    for ns in "${NS[@]}"; do ip netns del "$ns" 2>/dev/null || true; done
}
remove_namespaces
work=$(mktemp -d)
trap 'remove_namespaces; rm -rf "$work"' EXIT

for i in 0 1; do
    ip netns add "${NS[$i]}"
    ip -n "${NS[$i]}" link set lo up
done
ip link add "${VETH[0]}" netns "${NS[0]}" type veth peer name "${VETH[1]}" netns "${NS[1]}"
for i in 0 1; do
    ip -n "${NS[$i]}" addr add "${IPS[$i]}/24" dev "${VETH[$i]}"
    ip -n "${NS[$i]}" link set "${VETH[$i]}" up
done
# The link is up: both ends answer (no ping needed).
# grep reads all of ip's output (-q would stop at the match, and ip's
# next write would end it with SIGPIPE: a 141 under pipefail).
ip -n "${NS[1]}" addr show "${VETH[1]}" | grep "${IPS[1]}" >/dev/null

# OpenMPI calls the agent as `agent HOST COMMAND...`, as it would call ssh.
cat > "$work/agent" <<EOF
#!/bin/sh
host=\$1; shift
case "\$host" in
    ${IPS[0]}) ns=${NS[0]}; name=${HOSTS[0]} ;;
    ${IPS[1]}) ns=${NS[1]}; name=${HOSTS[1]} ;;
    *) echo "mpi-netns agent: unknown host \$host" >&2; exit 1 ;;
esac
exec ip netns exec "\$ns" unshare --uts sh -c "hostname \$name; \$*"
EOF
chmod +x "$work/agent"

text="$work/text.txt"
for _ in $(seq 100); do printf 'to be or not to be, that is the question. '; done > "$text"
gpt_args() { # out steps
    echo train --model gpt --n-layer 1 --n-head 2 --n-embd 16 --block-size 16 --batch-size 4 \
        --max-steps "$2" --eval-every 5 --eval-batches 1 --sample-tokens 0 --seed 3 \
        --text "$text" --out "$1" --plot "$work/loss.png"
}
final_loss() { sed -n 's/^final validation loss //p' "$1" | tail -1; }

export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp} LP_NUM_THREADS=1
# Both ranks, one per namespace, TCP over the veth only. Extra env first.
job() { # log limit_s env... -- wgrad args...
    local log=$1 limit=$2; shift 2
    local envs=()
    while [ "$1" != -- ]; do envs+=(-x "$1"); shift; done
    shift
    timeout --kill-after=10 "$limit" ip netns exec "${NS[0]}" unshare --uts sh -c 'hostname '"${HOSTS[0]}"'; exec "$@"' sh \
        mpirun --allow-run-as-root --host "${IPS[0]},${IPS[1]}" -np 2 --map-by node \
        --mca plm_rsh_agent "$work/agent" --mca plm_rsh_no_tree_spawn 1 \
        --mca btl tcp,self --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include 10.77.0.0/24 \
        --mca oob_tcp_keepalive_time 5 --mca oob_tcp_keepalive_intvl 2 --mca oob_tcp_keepalive_probes 3 \
        -x XDG_RUNTIME_DIR -x LP_NUM_THREADS -x OMPI_MCA_mpi_yield_when_idle=1 "${envs[@]}" \
        "$WGRAD" "$@" --distributed mpi --parallel zero --zero-stage 2 >"$log" 2>&1
}

echo "mpi-netns: one device"
# shellcheck disable=SC2046
"$WGRAD" $(gpt_args "$work/single" 10) >"$work/single.log" 2>&1 || { cat "$work/single.log"; exit 1; }
want=$(final_loss "$work/single.log")

echo "mpi-netns: ZeRO-2 over 2 ranks on ${HOSTS[*]} through ${VETH[0]}"
# shellcheck disable=SC2046
if ! job "$work/zero.log" 120 -- $(gpt_args "$work/zero" 10); then
    cat "$work/zero.log"
    echo "mpi-netns: the ZeRO-2 job failed" >&2
    exit 1
fi
got=$(final_loss "$work/zero.log")
grep -q "ZeRO stage 2" "$work/zero.log" || { cat "$work/zero.log"; echo "mpi-netns: not a ZeRO-2 run" >&2; exit 1; }
echo "mpi-netns: final validation loss $got over the link, $want on one device"
awk -v a="$got" -v b="$want" 'BEGIN { d = a - b; if (d < 0) d = -d; exit !(a != "" && d <= 1e-3 * b) }' ||
    { cat "$work/zero.log"; echo "mpi-netns: $got differs from $want by more than 1e-3 relative" >&2; exit 1; }

echo "mpi-netns: cutting ${HOSTS[1]}'s link mid-run"
start=$(date +%s)
# shellcheck disable=SC2046
job "$work/cut.log" 100 WGRAD_TIMEOUT_S=15 -- $(gpt_args "$work/cut" 100000) &
pid=$!
# Cut once the ranks are stepping (the engine is built and printed).
for _ in $(seq 120); do
    grep -q "memory per device" "$work/cut.log" 2>/dev/null && break
    sleep 0.5
done
sleep 3
ip -n "${NS[1]}" link set "${VETH[1]}" down
status=0
wait "$pid" || status=$?
elapsed=$(( $(date +%s) - start ))
if [ "$status" = 124 ] || [ "$status" = 137 ]; then
    cat "$work/cut.log"
    echo "mpi-netns: the job hung after the link went down (killed after ${elapsed} s)" >&2
    exit 1
fi
if [ "$status" = 0 ]; then
    cat "$work/cut.log"
    echo "mpi-netns: the job succeeded without its link" >&2
    exit 1
fi
if ! grep -E "rank [01] of 2 on wgrad-host[01]|wgrad-host1|${IPS[1]}" "$work/cut.log" >"$work/named.txt"; then
    cat "$work/cut.log"
    echo "mpi-netns: the job ended (status $status) without naming a rank or host" >&2
    exit 1
fi
echo "mpi-netns: the job ended after ${elapsed} s with status $status; its last lines:"
grep -v "validation loss" "$work/cut.log" | tail -12
echo "mpi-netns: ok"
