#!/usr/bin/env bash
# Runs one short training of each model on Vulkan under the Khronos
# validation layer (Chromium's copy, /usr/lib/chromium) and fails on any
# validation error but one: VUID-StandaloneSpirv-None-10684, which naga
# causes by decorating Workgroup and Private variables' types with
# Offset/ArrayStride; its fix is upstream in gfx-rs/wgpu pull request 9295
# (open). Remove the filter once wgrad's naga has it.
#
# Usage: scripts/vk-validation.sh [path/to/wgrad]. Without the layer it
# fails under CI (CI=true) and skips elsewhere; scripts/ensure-chromium.sh
# installs it.
set -u
wgrad=${1:-target/release/wgrad}
layer=/usr/lib/chromium/libVkLayer_khronos_validation.so
allowed='VUID-StandaloneSpirv-None-10684'

if [ ! -e "$layer" ]; then
    if [ "${CI:-}" = true ] || [ "${CI:-}" = 1 ]; then
        echo "vk-validation: $layer missing (run scripts/ensure-chromium.sh)" >&2
        exit 1
    fi
    echo "vk-validation: SKIP: $layer missing (scripts/ensure-chromium.sh installs it)" >&2
    exit 0
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
# Chromium ships the layer without a manifest; the loader needs one.
cat > "$dir/VkLayer_khronos_validation.json" <<JSON
{"file_format_version": "1.2.0", "layer": {"name": "VK_LAYER_KHRONOS_validation", "type": "GLOBAL",
 "library_path": "$layer", "api_version": "1.3.290",
 "implementation_version": "1", "description": "Khronos validation layer (from Chromium)"}}
JSON
export VK_LAYER_PATH=$dir VK_INSTANCE_LAYERS=VK_LAYER_KHRONOS_validation XDG_RUNTIME_DIR=${XDG_RUNTIME_DIR:-/tmp}
# The loader's layer messages show that the layer was really inserted.
export VK_LOADER_DEBUG=layer

status=0
run() {
    local name=$1
    shift
    local log="$dir/$name.log"
    local start=$SECONDS
    if ! "$wgrad" "$@" --backend vulkan >"$log" 2>&1; then
        echo "vk-validation: $name: wgrad failed:" >&2
        tail -20 "$log" >&2
        status=1
        return
    fi
    # The layer prints each message as "Validation Error: [ ID ] | ...".
    local ids others
    ids=$(grep -o 'Validation Error: \[ [^ ]* \]' "$log" | sed 's/.*\[ \(.*\) \]/\1/')
    others=$(printf '%s\n' "$ids" | grep -v -x -e "$allowed" -e '' | sort | uniq -c)
    # The loader says when it inserts the layer (VK_LOADER_DEBUG=layer).
    if ! grep -q 'Insert instance layer "VK_LAYER_KHRONOS_validation"' "$log"; then
        echo "vk-validation: $name: the validation layer was not loaded" >&2
        tail -20 "$log" >&2
        status=1
        return
    fi
    if [ -n "$others" ]; then
        echo "vk-validation: $name: validation errors:" >&2
        echo "$others" >&2
        grep -A4 'Validation Error' "$log" | grep -v -e "$allowed" | head -40 >&2
        status=1
        return
    fi
    echo "vk-validation: $name: no validation error but $(printf '%s\n' "$ids" | grep -c -x -e "$allowed") x $allowed (upstream, filtered) in $((SECONDS - start)) s"
}
out="$dir/out"
run mlp train --model mlp --max-steps 5 --checkpoint "$out/digits.safetensors" --plot "$out/digits.png"
run gpt train --max-steps 2 --eval-batches 1 --sample-tokens 8 --out "$out/gpt" --plot "$out/gpt.png"
run gpt-generate generate --model "$out/gpt" --prompt "ROMEO:" --max-new-tokens 8
run llama train --model llama --max-steps 2 --eval-batches 1 --sample-tokens 8 --out "$out/llama" --plot "$out/llama.png"
# A real model's quantized kernels (make test fetched the file).
smollm2=$(bash "$(dirname "$0")/fetch-smollm2.sh")
run smollm2-generate generate --model "$smollm2" --prompt "The capital of France is" --max-new-tokens 4 --temperature 0
exit $status
