#!/usr/bin/env bash
# make test's run of the test binaries, two at a time: the library's suite
# (tests/suite, one binary), the library's unit tests and the CLI's tests
# (cli/tests/*.rs: each runs the `wgrad` binary, the browser and MPI), the
# doc tests, the example and the `openai` client's checks
# (scripts/serve-openai-check.sh) are jobs in one queue, longest first,
# that two workers take from as they finish. On two cores neither kind
# keeps both busy alone: the suite's threads wait on the driver's queue and
# on GL's one context, the CLI's on the processes they start. Longest
# first, so that with cold driver caches the suite (the longest) runs
# beside all the rest, and with warm ones the worker that finishes first
# takes what is left. Each job's output is printed whole when it ends;
# the run fails if any job failed.
#
# Usage: scripts/test-lanes.sh [cargo test options...], e.g. `--release
# --features mpi,fault-injection` (the build `make test` made just before;
# cargo runs it, building nothing). Target filters, not `-p`: selecting
# packages resolves features apart and rebuilds shared crates.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cargo=${CARGO:-cargo}
cd "$root"

# The order jobs start in: the longest first (cold caches, 2 cores,
# 2026-12-07: the suite ~520 s, web_chromium ~270, cli_train ~50,
# webgpu_chromium ~50, cli_export ~37, serve ~26, cli_qlora ~24, ...);
# CLI tests not named here run after them, then the unit tests.
longest=(suite web_chromium cli_train webgpu_chromium cli_export serve cli_qlora cli_perplexity mpi
    cli_mistral cli_smollm2 cli_generate)
queue=()
for name in "${longest[@]}"; do
    if [ "$name" = suite ] || [ -f "cli/tests/$name.rs" ]; then
        queue+=("$name")
    fi
done
for file in cli/tests/*.rs; do
    name=$(basename "$file" .rs)
    [[ " ${longest[*]} " == *" $name "* ]] || queue+=("$name")
done
# The short jobs that are not test binaries last: the library's unit and
# doc tests, the example, and the real clients against `wgrad serve`.
queue+=(lib doc example openai openai-gemma)

# The binary the build made, for the jobs that run it outside cargo.
target_dir=$("$cargo" metadata --no-deps --format-version 1 | sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
wgrad="$target_dir/release/wgrad"

work=$(mktemp -d "${TMPDIR:-/tmp}/wgrad-lanes.XXXXXX")
trap 'kill $(jobs -p) 2>/dev/null; rm -rf "$work"' EXIT
printf '%s\n' "${queue[@]}" >"$work/queue"
: >"$work/failed"

# Takes the queue's first job (empty when none is left).
take() {
    (
        flock 9
        head -n 1 "$work/queue"
        sed -i '1d' "$work/queue"
    ) 9>"$work/lock"
}

# Runs job `name` with cargo's options after it.
run() {
    local name=$1
    shift
    case "$name" in
    lib) "$cargo" test "$@" --lib ;;
    doc) "$cargo" test "$@" --doc ;;
    example) "$cargo" run "$@" --example linear_regression ;;
    openai) scripts/serve-openai-check.sh --wgrad "$wgrad" ;;
    openai-gemma)
        scripts/serve-openai-check.sh --wgrad "$wgrad" --completions-only \
            --model "$(bash scripts/fetch-gemma3.sh)"
        ;;
    *) "$cargo" test "$@" --test "$name" ;;
    esac
}

worker() {
    local name log status
    while name=$(take) && [ -n "$name" ]; do
        log="$work/$name.log"
        run "$name" "$@" >"$log" 2>&1
        status=$?
        (
            flock 9
            echo "---- $name (exit $status) ----"
            cat "$log"
            [ "$status" = 0 ] || echo "$name" >>"$work/failed"
        ) 9>"$work/lock"
    done
}

echo "test-lanes: ${#queue[@]} jobs, two at a time: ${queue[*]}"
worker "$@" &
first=$!
worker "$@" &
second=$!
wait "$first"
wait "$second"
if [ -s "$work/failed" ]; then
    echo "test-lanes: failed: $(tr '\n' ' ' <"$work/failed")" >&2
    exit 1
fi
