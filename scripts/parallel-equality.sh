#!/usr/bin/env bash
# Trains every language-model family `wgrad train --model` offers for 30
# steps on one device and under each --parallel engine on 2 devices, and
# prints a table of the final training losses against the single-device one
# (relative difference, PASS at <= 1e-3; issue 37's Done-when):
#
#     scripts/parallel-equality.sh                      # every family, every engine
#     MODELS="llama gemma3" STRATEGIES="tensor zero3" scripts/parallel-equality.sh
#
# Strategies: data, tensor, pipeline, zero (the default ZeRO stage), zero1,
# zero2, zero3. WGRAD is the binary (default: target/release/wgrad, built
# with `cargo build --release -p wgrad-cli` when missing); DEVICES (default
# 2) and EXTRA (flags for every run, e.g. `--backend vulkan`) pass through.
# Each run's output is kept in $LOGS (default /tmp/parallel-equality).
# Exits 1 when any run fails or differs beyond the tolerance.
set -uo pipefail

cd "$(dirname "$0")/.."
MODELS=${MODELS:-gpt llama qwen2 qwen3 mistral gemma3}
STRATEGIES=${STRATEGIES:-data tensor pipeline zero1 zero2 zero3}
DEVICES=${DEVICES:-2}
EXTRA=${EXTRA:-}
STEPS=${STEPS:-30}
SEED=${SEED:-3}
TOLERANCE=${TOLERANCE:-1e-3}
LOGS=${LOGS:-/tmp/parallel-equality}
WGRAD=${WGRAD:-target/release/wgrad}
export XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}

if [ ! -x "$WGRAD" ]; then
    cargo build --release -p wgrad-cli || exit 2
fi
mkdir -p "$LOGS"

# run NAME FLAGS...: trains, keeps the log, prints the final training loss
# (or nothing when the run failed).
run() {
    local name=$1
    shift
    # shellcheck disable=SC2086  # EXTRA is a list of flags
    "$WGRAD" train --max-steps "$STEPS" --seed "$SEED" --sample-tokens 0 \
        --out "$LOGS/$name.out" --plot "$LOGS/$name.png" $EXTRA "$@" > "$LOGS/$name.log" 2>&1 || return 0
    sed -n 's/^final training loss \([^ ]*\) .*/\1/p' "$LOGS/$name.log"
}

# The flags of one strategy.
strategy_flags() {
    case $1 in
        zero[123]) echo "--parallel zero --zero-stage ${1#zero} --devices $DEVICES" ;;
        *) echo "--parallel $1 --devices $DEVICES" ;;
    esac
}

failed=0
printf '%-8s %-9s %-10s %-10s %-9s %s\n' model strategy loss single relative result
for model in $MODELS; do
    single=$(run "$model-single" --model "$model")
    if [ -z "$single" ]; then
        printf '%-8s %-9s %-10s %-10s %-9s %s\n' "$model" single - - - "FAIL (see $LOGS/$model-single.log)"
        failed=1
        continue
    fi
    printf '%-8s %-9s %-10s %-10s %-9s %s\n' "$model" single "$single" "$single" 0 -
    for strategy in $STRATEGIES; do
        # shellcheck disable=SC2046  # the strategy's flags are words
        loss=$(run "$model-$strategy" --model "$model" $(strategy_flags "$strategy"))
        if [ -z "$loss" ]; then
            printf '%-8s %-9s %-10s %-10s %-9s %s\n' "$model" "$strategy" - "$single" - \
                "FAIL (see $LOGS/$model-$strategy.log)"
            failed=1
            continue
        fi
        read -r relative verdict < <(awk -v a="$loss" -v b="$single" -v t="$TOLERANCE" 'BEGIN {
            d = a - b; if (d < 0) d = -d; r = d / (b < 0 ? -b : b);
            printf "%.2e %s\n", r, (r <= t ? "PASS" : "FAIL") }')
        [ "$verdict" = PASS ] || failed=1
        printf '%-8s %-9s %-10s %-10s %-9s %s\n' "$model" "$strategy" "$loss" "$single" "$relative" "$verdict"
    done
done
exit $failed
