#!/usr/bin/env bash
# make test's run of the test binaries, in two lanes at once: the library's
# suite (tests/suite, one binary) in the background, and the library's unit
# tests with the CLI's tests (cli/tests/*.rs: each runs the `wgrad` binary,
# the browser and MPI) in the foreground. On two cores neither lane keeps
# both busy: the suite's threads wait on the driver's queue and on GL's one
# context, the CLI's on the processes they start. The suite's output is
# printed after the CLI's, as one block; the run fails if either lane
# failed.
#
# Usage: scripts/test-lanes.sh [cargo test options...], e.g. `--release
# --features mpi,fault-injection` (the build `make test` made just before;
# cargo runs it, building nothing). Target filters, not `-p`: selecting
# packages resolves features apart and rebuilds shared crates.
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cargo=${CARGO:-cargo}
cd "$root"

cli_tests=()
for file in cli/tests/*.rs; do
    cli_tests+=(--test "$(basename "$file" .rs)")
done

log=$(mktemp "${TMPDIR:-/tmp}/wgrad-suite.XXXXXX")
"$cargo" test "$@" --test suite >"$log" 2>&1 &
suite=$!
trap 'kill "$suite" 2>/dev/null; rm -f "$log"' EXIT
echo "test-lanes: the suite runs beside these tests; its output follows theirs"

cli_status=0
"$cargo" test "$@" --lib "${cli_tests[@]}" || cli_status=$?

suite_status=0
wait "$suite" || suite_status=$?
echo "---- the suite (tests/suite), run beside the tests above ----"
cat "$log"
if [ "$cli_status" != 0 ] || [ "$suite_status" != 0 ]; then
    echo "test-lanes: failed (unit and CLI tests: exit $cli_status; suite: exit $suite_status)" >&2
    exit 1
fi
