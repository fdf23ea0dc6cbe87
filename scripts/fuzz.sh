#!/usr/bin/env bash
# Fuzzes one target of fuzz/ for SECONDS with libFuzzer under
# AddressSanitizer, on stable Rust (fuzz/README.md says why each setting):
#
#     scripts/fuzz.sh gguf 600        # targets: gguf, hf_folder, tokenizer
#
# Needs `cargo install cargo-fuzz`. New corpus entries go to
# fuzz/corpus/TARGET (git-ignored), findings to fuzz/artifacts/TARGET.
# Extra arguments after SECONDS go to libFuzzer (e.g. -jobs=1).
set -euo pipefail

if [ $# -lt 2 ]; then
    echo "usage: $0 TARGET SECONDS [libFuzzer flags...]  (targets: gguf, hf_folder, tokenizer)" >&2
    exit 2
fi
target=$1 seconds=$2
shift 2
cd "$(dirname "$0")/../fuzz"
case $target in
    gguf | tokenizer) dict=gguf.dict ;;
    hf_folder) dict=hf_folder.dict ;;
    *) echo "unknown target '$target' (gguf, hf_folder, tokenizer)" >&2; exit 2 ;;
esac
if ! command -v cargo-fuzz > /dev/null; then
    echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
    exit 2
fi
# hf_folder writes its files here: memory, not the disk, when there is one.
if [ -z "${TMPDIR:-}" ] && [ -d /dev/shm ] && [ -w /dev/shm ]; then
    export TMPDIR=/dev/shm
fi
mkdir -p "corpus/$target"
# cargo-fuzz passes nightly-only flags (-Zsanitizer=address, …) to rustc;
# RUSTC_BOOTSTRAP lets a stable rustc accept them.
export RUSTC_BOOTSTRAP=1
exec cargo fuzz run "$target" "corpus/$target" "seeds/$target" -- \
    -max_total_time="$seconds" \
    -max_len=1048576 \
    -malloc_limit_mb=512 \
    -rss_limit_mb=1024 \
    -timeout=10 \
    -dict="$dict" \
    -print_final_stats=1 \
    "$@"
