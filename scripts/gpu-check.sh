#!/usr/bin/env bash
# The check to run once on a machine with a real GPU: the test suite on the
# best adapter (the one wgrad picks by policy: discrete before integrated
# before software), `wgrad tune`, and `wgrad bench`, in under 8 minutes,
# into one report file.
#
# Usage: scripts/gpu-check.sh [REPORT]   (default: gpu-check-report.txt)
# Uses cargo when present; on a machine without Rust, build here first
# (`cargo build --release && cargo test --release --no-run`) and bring
# target/release/wgrad and target/release/deps/suite-* along: the script
# finds them. Each stage has a time limit, so a hang costs minutes, not the
# whole check.
set -u
cd "$(dirname "$0")/.."
report=${1:-gpu-check-report.txt}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
start=$SECONDS
: >"$report"
say() { echo "$@" | tee -a "$report"; }
stage() {
    local name=$1 limit=$2
    shift 2
    say ""
    say "== $name (limit ${limit} s): $*"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >>"$report" 2>&1
    local rc=$?
    say "== $name: exit $rc after $((SECONDS - t0)) s"
    return $rc
}

if command -v cargo >/dev/null 2>&1; then
    stage build 300 cargo test --release --no-run || true
    stage build-cli 120 cargo build --release --bin wgrad || true
fi
wgrad=target/release/wgrad
suite=$(ls -t target/release/deps/suite-* 2>/dev/null | grep -v '\.d$' | head -1)
if [ ! -x "$wgrad" ] || [ -z "$suite" ]; then
    say "gpu-check: no target/release/wgrad or suite binary; build them first (see this script's header)"
    exit 1
fi

say "gpu-check $(date -u +%FT%TZ) at $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >>"$report" 2>&1
stage adapters 60 "$wgrad" adapters
# The best adapter by wgrad's policy; its index runs the suite alone.
best=$("$wgrad" adapters 2>/dev/null | awk '
    /^\[[0-9]+\]/ { idx = substr($1, 2, length($1) - 2) }
    /type:/ { t = $NF; rank = (t == "DiscreteGpu") ? 0 : (t == "IntegratedGpu") ? 1 : (t == "VirtualGpu") ? 2 : 3
              if ($0 ~ /backend: Gl/) rank += 0.5
              if (best == "" || rank < bestrank) { best = idx; bestrank = rank } }
    END { print best }')
say "best adapter: [$best]"
export WGRAD_ADAPTER=$best WGRAD_TEST_ADAPTER=$best
# The suite's data-parallel tests open every adapter present; keep the
# check on the GPU.
stage suite 240 "$suite" --test-threads=2 || true
stage tune 90 "$wgrad" tune || true
stage bench 150 "$wgrad" bench --quick || true
say ""
say "gpu-check: done in $((SECONDS - start)) s; report in $report"
grep -E '^test result|^bench |^== ' "$report" | tail -40
