#!/usr/bin/env bash
# Builds the browser page (`make web-build`, and the headless-Chromium test
# cli/tests/web_chromium.rs): wgrad-web for wasm32 (the `web` profile), its
# JavaScript bindings by wasm-bindgen, and the static files beside them:
#
#   OUT/index.html, app.js, selftest.js     web/www
#   OUT/pkg/wgrad_web.js, wgrad_web_bg.wasm  the engine
#   OUT/data/shakespeare.txt.gz              the text the page trains on
#   OUT/models/index.json (+ a link)         SmolLM2's GGUF when it is in
#                                            wgrad's cache (make smollm2)
#
#   scripts/build-web.sh [OUT]   # default: <target dir>/web; prints OUT
#
# Exits 3, saying what to install, when the wasm32 target or wasm-bindgen
# (at the exact version Cargo.lock pins) is missing.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cargo=${CARGO:-cargo}
target_dir=$("$cargo" metadata --no-deps --format-version 1 --manifest-path "$root/Cargo.toml" |
    sed -n 's/.*"target_directory":"\([^"]*\)".*/\1/p')
out=${1:-$target_dir/web}

# The version wasm-bindgen-cli must have: the crate's, as Cargo.lock pins it.
want=$(sed -n '/^name = "wasm-bindgen"$/{n;s/^version = "\(.*\)"$/\1/p}' "$root/Cargo.lock")
if ! rustup target list --installed 2>/dev/null | grep -qx wasm32-unknown-unknown; then
    echo "build-web: the wasm32-unknown-unknown target is missing: rustup target add wasm32-unknown-unknown" >&2
    exit 3
fi
have=$(wasm-bindgen --version 2>/dev/null | awk '{print $2}' || true)
if [ "$have" != "$want" ]; then
    echo "build-web: wasm-bindgen $want is needed (found: ${have:-none}): cargo install wasm-bindgen-cli --version $want (--locked fails while a crate its lock file pins is yanked)" >&2
    exit 3
fi

# The `web` profile: release, optimised as one unit and for size (Cargo.toml).
# WGRAD_WEB_PROFILE=release or web-test builds it in minutes less (no
# whole-program optimisation; a larger .wasm, the same numbers): web-test,
# release with start-up-only crates optimised less, is the Chromium test's.
profile=${WGRAD_WEB_PROFILE:-web}
"$cargo" build --profile "$profile" -p wgrad-web --target wasm32-unknown-unknown --manifest-path "$root/Cargo.toml" >&2
mkdir -p "$out/pkg" "$out/data" "$out/models"
# The name section (0.8 MB of function names) only labels stack traces;
# wgrad's errors and panics reach the console with their messages.
wasm-bindgen --target web --no-typescript --remove-name-section --out-dir "$out/pkg" \
    "$target_dir/wasm32-unknown-unknown/$profile/wgrad_web.wasm"
cp "$root"/web/www/*.html "$root"/web/www/*.js "$out/"
cp "$root/data/shakespeare.txt.gz" "$out/data/"

# SmolLM2, served beside the page when wgrad's cache has it (linked, not
# copied: 98 MB).
rm -f "$out"/models/*.gguf
source "$root/scripts/pypi-file.sh"
smollm2=$(model_destination "${WGRAD_SMOLLM2:-}" SmolLM2-135M-Instruct.Q4_1.gguf)
if [ -n "$smollm2" ] && [ -f "$smollm2" ]; then
    ln -sf "$smollm2" "$out/models/$(basename "$smollm2")"
    printf '["%s"]\n' "$(basename "$smollm2")" >"$out/models/index.json"
else
    echo '[]' >"$out/models/index.json"
fi
wasm="$out/pkg/wgrad_web_bg.wasm"
echo "build-web: $(du -k "$wasm" | cut -f1) KiB of wasm (profile $profile) ($(gzip -9 -c "$wasm" | wc -c | awk '{printf "%d", $1 / 1024}') KiB gzipped) in $out" >&2
echo "$out"
