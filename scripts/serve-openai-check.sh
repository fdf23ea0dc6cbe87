#!/usr/bin/env bash
# Checks `wgrad serve` with real clients: the official `openai` Python
# package (streamed and not: issue 28's Done-when call) and curl, against a
# server started on a free loopback port. Exits non-zero on any mismatch.
#
#   scripts/serve-openai-check.sh                      # the tiny GGUF fixture
#   scripts/serve-openai-check.sh --model ~/.cache/wgrad/models/SmolLM2-135M-Instruct.Q4_1.gguf --expect Paris
#   scripts/serve-openai-check.sh --wgrad target/release/wgrad   # that binary, no cargo build
#   scripts/serve-openai-check.sh --completions-only --model ~/.cache/wgrad/models/gemma-3-270m-q4_k_m.gguf --expect Paris
#   scripts/serve-openai-check.sh --install-only       # make the client's venv and stop (CI's install step)
#   scripts/serve-openai-check.sh --model M.gguf --lora mine=out/lora --lora other=out/lora2
#
# --completions-only is for a base model without a chat template (Gemma 3
# 270M): /v1/completions through the client, streamed and not, and the chat
# endpoint's refusal as an OpenAI-format 400.
#
# The fixture (random weights, a 32-position context) is served from a copy
# whose header says 4096 positions, as cli/tests/serve.rs does, so the
# question fits; its answer is noise, so only the protocol is checked.
# With --expect WORD both answers must contain WORD. The venv (openai) is
# made under $XDG_CACHE_HOME/wgrad (or ~/.cache/wgrad), never in the repo.
#
# LoRA adapters (`--lora NAME=DIR`, repeated; on the fixture without
# --model, two the script writes: ranks 2 and 8 over its quantized base) are
# served over the model, and the client checks each: listed in /v1/models
# with the base as parent, and its greedy completion the text `wgrad
# generate --lora DIR` gives, asked alone and with every adapter (and the
# base) in flight together.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
model=""
expect=""
max_context=256
wgrad=""
completions_only=""
install_only=""
loras=()
while [ $# -gt 0 ]; do
    case "$1" in
        --model) model=$2; shift 2 ;;
        --expect) expect=$2; shift 2 ;;
        --max-context) max_context=$2; shift 2 ;;
        --wgrad) wgrad=$2; shift 2 ;;
        --completions-only) completions_only=1; shift ;;
        --install-only) install_only=1; shift ;;
        --lora) loras+=("$2"); shift 2 ;;
        *) echo "usage: $0 [--model FILE.gguf|FOLDER] [--expect WORD] [--max-context T] [--wgrad BINARY] [--completions-only] [--install-only] [--lora NAME=DIR]..." >&2; exit 2 ;;
    esac
done

work=$(mktemp -d)
server_pid=""
cleanup() {
    if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

cache=${XDG_CACHE_HOME:-$HOME/.cache}/wgrad
venv=$cache/serve-check-venv
if [ ! -x "$venv/bin/python" ] || ! "$venv/bin/python" -c "import openai" 2>/dev/null; then
    mkdir -p "$cache"
    python3 -m venv "$venv"
    "$venv/bin/pip" install --quiet --disable-pip-version-check openai
fi
py=$venv/bin/python
if [ -n "$install_only" ]; then
    echo "serve-openai-check: the openai client is in $venv"
    exit 0
fi

if [ -z "$model" ]; then
    model=$work/tiny-llama.gguf
    "$py" - "$root/tests/fixtures/gguf-llama.gguf" "$model" <<'EOF'
import struct, sys
data = bytearray(open(sys.argv[1], "rb").read())
key = b"llama.context_length"
at = data.index(key) + len(key)
assert struct.unpack_from("<II", data, at) == (4, 32), "a u32 context of 32"
struct.pack_into("<I", data, at + 4, 4096)
open(sys.argv[2], "wb").write(data)
EOF
    if [ ${#loras[@]} -eq 0 ]; then
        # Two PEFT adapters over the fixture (hidden 64, KV 32, MLP 96, 2
        # layers), A and B uniform in ±0.5 from fixed seeds.
        "$py" - "$work" <<'EOF'
import json, os, random, struct, sys

sizes = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (64, 32), "self_attn.v_proj": (64, 32),
         "self_attn.o_proj": (64, 64), "mlp.gate_proj": (64, 96), "mlp.up_proj": (64, 96), "mlp.down_proj": (96, 64)}
for name, r, targets, seed in [("tiny-a", 2, ["self_attn.q_proj", "self_attn.v_proj"], 1),
                               ("tiny-b", 8, list(sizes), 2)]:
    folder = os.path.join(sys.argv[1], name)
    os.makedirs(folder)
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": 2 * r, "lora_dropout": 0.0,
              "target_modules": [t.split(".")[-1] for t in targets], "bias": "none"}
    json.dump(config, open(os.path.join(folder, "adapter_config.json"), "w"))
    rng, header, data = random.Random(seed), {}, bytearray()
    for layer in range(2):
        for target in targets:
            i, o = sizes[target]
            for matrix, shape in (("lora_A", [r, i]), ("lora_B", [o, r])):
                start = len(data)
                for _ in range(shape[0] * shape[1]):
                    data += struct.pack("<f", rng.uniform(-0.5, 0.5))
                header[f"base_model.model.model.layers.{layer}.{target}.{matrix}.weight"] = {
                    "dtype": "F32", "shape": shape, "data_offsets": [start, len(data)]}
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    open(os.path.join(folder, "adapter_model.safetensors"), "wb").write(struct.pack("<Q", len(text)) + text + data)
EOF
        loras=("tiny-a=$work/tiny-a" "tiny-b=$work/tiny-b")
    fi
fi
lora_args=()
for spec in ${loras[@]+"${loras[@]}"}; do
    lora_args+=(--lora "$spec")
done

if [ -z "$wgrad" ]; then
    (cd "$root" && cargo build --release -q -p wgrad-cli)
    wgrad=$root/target/release/wgrad
fi
"$wgrad" serve --model "$model" --port 0 --max-batch $((2 + ${#loras[@]})) --max-context "$max_context" ${lora_args[@]+"${lora_args[@]}"} > "$work/stdout" 2> "$work/stderr" &
server_pid=$!
for _ in $(seq 1 600); do
    grep -q "listening on" "$work/stdout" 2>/dev/null && break
    kill -0 "$server_pid" 2>/dev/null || { cat "$work/stderr" >&2; echo "FAIL: the server exited" >&2; exit 1; }
    sleep 0.2
done
address=$(grep -o "http://127.0.0.1:[0-9]*" "$work/stdout" | head -1)
[ -n "$address" ] || { cat "$work/stderr" >&2; echo "FAIL: no address" >&2; exit 1; }
model_id=$(sed -n 's/.*as model `\([^`]*\)`.*/\1/p' "$work/stdout")
echo "server: $address, model $model_id"

fail() { echo "FAIL: $*" >&2; exit 1; }

# Each --lora adapter through the client: listed, and its greedy completion
# `wgrad generate --lora`'s, alone and with the others and the base at once.
check_adapters() {
    [ ${#loras[@]} -gt 0 ] || return 0
    local prompt="The capital of France is"
    local spec
    for spec in "${loras[@]}"; do
        "$wgrad" generate --model "$model" --lora "${spec#*=}" --prompt "$prompt" --max-new-tokens 8 \
            --temperature 0 > "$work/generate-${spec%%=*}" 2> "$work/generate-stderr" \
            || { cat "$work/generate-stderr" >&2; fail "wgrad generate --lora ${spec#*=}"; }
    done
    "$py" - "$address" "$model_id" "$prompt" "$work" "${loras[@]}" <<'EOF'
import sys, threading
import openai

address, base, prompt, work = sys.argv[1:5]
names = [spec.split("=", 1)[0] for spec in sys.argv[5:]]
client = openai.OpenAI(base_url=f"{address}/v1", api_key="x")
listed = {m.id: m for m in client.models.list().data}
for name in names:
    assert name in listed and getattr(listed[name], "parent", None) == base, (name, listed)
want = {}
for name in names:
    printed = open(f"{work}/generate-{name}").read()
    assert printed.startswith(prompt) and printed.endswith("\n"), printed
    want[name] = printed[len(prompt):-1]

def complete(model):
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text

for name in names:
    got = complete(name)
    assert got == want[name], f"{name} alone: {got!r} != generate --lora's {want[name]!r}"
together = {}
threads = [threading.Thread(target=lambda m=m: together.__setitem__(m, complete(m))) for m in names + [base]]
for t in threads:
    t.start()
for t in threads:
    t.join()
for name in names:
    assert together[name] == want[name], f"{name} beside the others: {together[name]!r} != {want[name]!r}"
print(f"openai {openai.__version__}: adapters ok: " + ", ".join(f"{n} -> {want[n]!r}" for n in names))
EOF
}

if [ -n "$completions_only" ]; then
    curl -sf "$address/health" | grep '"status":"ok"' >/dev/null || fail "/health"
    "$py" - "$address" "$model_id" "$expect" <<'EOF'
import sys
import openai

address, model, expect = sys.argv[1:4]
client = openai.OpenAI(base_url=f"{address}/v1", api_key="x")
assert model in [m.id for m in client.models.list().data], "the model is listed"
prompt = "The capital of France is"
whole = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
answer = whole.choices[0].text
assert whole.object == "text_completion" and whole.choices[0].finish_reason in ("stop", "length"), whole
assert 0 < whole.usage.completion_tokens <= 8 and whole.usage.prompt_tokens > 0, whole.usage
stream = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stream=True)
streamed = "".join(c.choices[0].text for c in stream if c.choices)
assert streamed == answer, f"streamed {streamed!r} != whole {answer!r}"
try:
    client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}])
    raise AssertionError("a chat was answered by a model without a chat template")
except openai.BadRequestError as e:
    assert "template" in str(e), e
if expect:
    assert expect in answer, f"{expect!r} is not in {answer!r}"
print(f"openai {openai.__version__}: completions ok; {prompt!r} -> {answer!r}")
EOF
    check_adapters
    kill -TERM "$server_pid"
    wait "$server_pid" || fail "the server exited with $? after SIGTERM"
    server_pid=""
    echo "PASS"
    exit 0
fi

# curl: health, a streamed chat ending in [DONE], a malformed body's 400.
curl -sf "$address/health" | grep '"status":"ok"' >/dev/null || fail "/health"
curl -sfN "$address/v1/chat/completions" -H 'Content-Type: application/json' \
    -d "{\"model\":\"$model_id\",\"messages\":[{\"role\":\"user\",\"content\":\"Hi\"}],\"max_tokens\":4,\"stream\":true}" > "$work/sse"
tail -n 2 "$work/sse" | grep '^data: \[DONE\]' >/dev/null || fail "curl stream did not end with [DONE]: $(cat "$work/sse")"
status=$(curl -s -o "$work/bad" -w '%{http_code}' "$address/v1/chat/completions" -H 'Content-Type: application/json' -d '{"messages": [')
[ "$status" = 400 ] && grep -q '"error"' "$work/bad" || fail "malformed JSON gave $status: $(cat "$work/bad")"
echo "curl: ok"

"$py" - "$address" "$model_id" "$expect" <<'EOF'
import sys
import openai

address, model, expect = sys.argv[1:4]
client = openai.OpenAI(base_url=f"{address}/v1", api_key="x")
messages = [{"role": "user", "content": "What is the capital of France?"}]

assert model in [m.id for m in client.models.list().data], "the model is listed"

whole = client.chat.completions.create(model=model, messages=messages, temperature=0)
answer = whole.choices[0].message.content
assert whole.object == "chat.completion" and whole.choices[0].finish_reason in ("stop", "length"), whole
assert whole.usage.prompt_tokens > 0 and whole.usage.completion_tokens > 0, whole.usage
assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

pieces, finish, usage = [], None, None
for chunk in client.chat.completions.create(model=model, messages=messages, temperature=0, stream=True):
    if chunk.choices:
        pieces.append(chunk.choices[0].delta.content or "")
        finish = chunk.choices[0].finish_reason or finish
    usage = chunk.usage or usage
streamed = "".join(pieces)
assert streamed == answer, f"streamed {streamed!r} != whole {answer!r}"
assert finish == whole.choices[0].finish_reason and usage is not None and usage.completion_tokens == whole.usage.completion_tokens, (finish, usage)

text = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
assert text.object == "text_completion" and text.usage.completion_tokens <= 5, text

try:
    client.chat.completions.create(model="no-such-model", messages=messages)
    raise AssertionError("an unknown model was accepted")
except openai.NotFoundError:
    pass

if expect:
    assert expect in answer and expect in streamed, f"{expect!r} is not in {answer!r}"
print(f"openai {openai.__version__}: ok; answer ({whole.usage.completion_tokens} tokens): {answer!r}")
EOF
check_adapters
kill -TERM "$server_pid"
wait "$server_pid" || fail "the server exited with $? after SIGTERM"
server_pid=""
echo "PASS"
