#!/usr/bin/env python3
"""Writes the GGUF fixtures of tests/suite/gguf.rs with the `gguf` Python
package (llama.cpp's own writer and reader), so the Rust reader is checked
against files and values it did not make itself.

  tests/fixtures/gguf-tiny.gguf
      GGUF v3, default alignment (32, no `general.alignment` key), like the
      files llama.cpp's converter writes:
      - a tiny Llama (1 block, 32 channels, 4 heads, 2 KV heads, MLP 64) whose
        attn_q / attn_k rows are permuted exactly as convert_hf_to_gguf.py's
        `LlamaModel.permute` does (k with the KV head count);
      - a tiny byte-level BPE tokenizer's metadata (gpt2 model, 256 byte
        tokens, a few merges, special tokens, BOS 1, EOS 2, a ChatML
        template);
      - metadata of every value type, arrays of each, nested arrays;
      - random tensors of every type wgrad decodes (F32, F16, BF16, Q8_0,
        Q4_0, Q4_1) at odd shapes (1, primes, rank 3 and 4; quantized rows a
        multiple of 32), F16/BF16 special values, a constant quantized row
        (scale 0), and one Q5_K tensor (valid, but not decoded by wgrad).
  tests/fixtures/gguf-tiny.safetensors
      each decodable tensor de-quantized by `gguf.quants.dequantize`, in
      row-major shape (GGUF's dims reversed), plus `hf.<name>` for the
      Hugging Face q_proj / k_proj rows the permuted tensors came from.
  tests/fixtures/gguf-tiny.json
      what `gguf.GGUFReader` reads: version, alignment, data offset, every
      metadata key with its type and value, every tensor's type, dims
      (GGUF order), offset and size.
  tests/fixtures/gguf-align64.gguf (+ .json, .safetensors)
      a small file with `general.alignment = 64`.

Needs only `pip install gguf numpy` (gguf 0.19.0, numpy 2.4 when written):
    python3 scripts/make_gguf_fixture.py
"""

import json
import pathlib

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
rng = np.random.default_rng(25)

# The tiny Llama's sizes.
N_EMBD, N_HEAD, N_KV_HEAD, N_FF = 32, 4, 2, 64
HEAD_DIM = N_EMBD // N_HEAD


def permute(w, n_head, n_head_kv=None):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def bytes_to_unicode():
    """GPT-2's byte-to-character table (byte-level BPE's alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def tokenizer():
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = [bytes_to_unicode()[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ s", "r e", "Ġ w", "a t", "e n"]
    merged = ["".join(m.split(" ")) for m in merges]
    tokens = specials + alphabet + merged
    types = [gguf.TokenType.CONTROL] * len(specials) + [gguf.TokenType.NORMAL] * (len(tokens) - len(specials))
    return tokens, [int(t) for t in types], merges


CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Metadata of every value type, written with explicit types (the writer
# would make every Python int an INT32).
SCALARS = [
    ("wgrad.test.u8", 200, V.UINT8),
    ("wgrad.test.i8", -100, V.INT8),
    ("wgrad.test.u16", 65000, V.UINT16),
    ("wgrad.test.i16", -32000, V.INT16),
    ("wgrad.test.u32", 4_000_000_000, V.UINT32),
    ("wgrad.test.i32", -2_000_000_000, V.INT32),
    ("wgrad.test.f32", float(np.float32(3.1415927)), V.FLOAT32),
    ("wgrad.test.bool_true", True, V.BOOL),
    ("wgrad.test.bool_false", False, V.BOOL),
    ("wgrad.test.string", "héllo, wörld ✓ \n\t\"quoted\"", V.STRING),
    ("wgrad.test.u64", 2**63 + 12345, V.UINT64),
    ("wgrad.test.i64", -(2**62) - 7, V.INT64),
    ("wgrad.test.f64", 2.718281828459045, V.FLOAT64),
]
ARRAYS = [
    ("wgrad.test.array.u8", [0, 1, 255], V.UINT8),
    ("wgrad.test.array.i8", [-128, 0, 127], V.INT8),
    ("wgrad.test.array.u16", [0, 65535], V.UINT16),
    ("wgrad.test.array.i16", [-32768, 32767, 5], V.INT16),
    ("wgrad.test.array.u32", [0, 4294967295], V.UINT32),
    ("wgrad.test.array.i32", [-2147483648, 2147483647, -1], V.INT32),
    ("wgrad.test.array.f32", [float(np.float32(x)) for x in (0.5, -1.25, 1e-30, 3.0e38)], V.FLOAT32),
    ("wgrad.test.array.bool", [True, False, True], V.BOOL),
    ("wgrad.test.array.string", ["a", "", "ünï ✓", "<|im_end|>"], V.STRING),
    ("wgrad.test.array.u64", [0, 2**64 - 1], V.UINT64),
    ("wgrad.test.array.i64", [-(2**63), 2**63 - 1], V.INT64),
    ("wgrad.test.array.f64", [1.0 / 3.0, -0.0, 1e300], V.FLOAT64),
]
# Arrays of arrays (the writer infers the inner element type from the first
# item: Python ints are INT32, strings STRING).
NESTED = [
    ("wgrad.test.array.nested_i32", [[1, 2, 3], [4], [-5, 6]]),
    ("wgrad.test.array.nested_string", [["x", "yz"], ["é"]]),
    ("wgrad.test.array.nested_deep", [[[1], [2, 3]], [[4, 5, 6]]]),
]


def quantize(values, qtype):
    """Raw block bytes of `values` (float32, row-major) in `qtype`."""
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype == Q.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values.astype(np.float32), qtype)


def add_tensor(writer, refs, name, values, qtype):
    data = quantize(values, qtype)
    if qtype in (Q.F32, Q.F16):
        writer.add_tensor(name, data)
    else:
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
    # The reference: what llama.cpp's Python package de-quantizes the
    # stored bytes to (not the values before quantization).
    raw = data.view(np.uint8) if qtype in (Q.F32, Q.F16) else data
    deq = gguf.quants.dequantize(raw if qtype not in (Q.F32, Q.F16) else data, qtype)
    refs[name] = np.ascontiguousarray(deq.astype(np.float32).reshape(values.shape))


def special_f16():
    # ±0, the smallest subnormal, the largest subnormal, the smallest
    # normal, 1, the largest finite, ±inf.
    bits = np.array([0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00], dtype=np.uint16)
    return bits.view(np.float16).astype(np.float32)


def special_bf16():
    bits = np.array([0x0000, 0x8000, 0x0001, 0x007F, 0x0080, 0x3F80, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80], dtype=np.uint32) << 16
    return bits.view(np.float32)


def metadata_json(reader, nested):
    """Every key as the reader reads it: its value type, the element type
    of arrays, and the value. The reader flattens nested arrays
    (`ReaderField.contents` has a FIXME for them), so for those the
    structure written is recorded, after checking the reader's flat view
    equals it flattened."""

    def flatten(v):
        return [y for x in v for y in flatten(x)] if isinstance(v, list) else [v]

    out = []
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        entry = {"key": key, "type": V(field.types[0]).name}
        value = field.contents()
        if field.types[0] == V.ARRAY:
            entry["element"] = V(field.types[1]).name
            if key in nested:
                assert flatten(nested[key]) == value, key
                value = nested[key]
        if isinstance(value, float) and field.types[0] == V.FLOAT32:
            value = float(np.float32(value))
        entry["value"] = value.item() if isinstance(value, np.generic) else value
        out.append(entry)
    return out


def tensors_json(reader):
    return [
        {
            "name": t.name,
            "type": Q(t.tensor_type).name,
            "dims": [int(d) for d in t.shape],
            "offset": int(t.data_offset) - int(reader.data_offset),
            "n_elements": int(t.n_elements),
            "n_bytes": int(t.n_bytes),
        }
        for t in reader.tensors
    ]


def save_safetensors(tensors, path):
    """float32 tensors in the safetensors format (8-byte little-endian
    header length, JSON header, data), written here so the script needs
    only gguf and numpy."""
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(blobs))


def save(stem, writer, refs, nested):
    path = OUT / f"{stem}.gguf"
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    reader = gguf.GGUFReader(path)
    # The reader's own de-quantization of each tensor as read back from the
    # file equals the reference computed from the bytes written.
    for t in reader.tensors:
        if t.name in refs:
            deq = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            assert np.array_equal(deq.reshape(-1).view(np.uint32), refs[t.name].reshape(-1).view(np.uint32)), t.name
    info = {
        "version": int(reader.fields["GGUF.version"].parts[0][0]),
        "alignment": int(reader.alignment),
        "data_offset": int(reader.data_offset),
        "file_size": path.stat().st_size,
        "metadata": metadata_json(reader, nested),
        "tensors": tensors_json(reader),
    }
    (OUT / f"{stem}.json").write_text(json.dumps(info, indent=1, ensure_ascii=False) + "\n")
    save_safetensors(refs, OUT / f"{stem}.safetensors")
    print(f"{path}: {path.stat().st_size} bytes, {len(reader.tensors)} tensors, {len(info['metadata'])} keys")


def tiny():
    w = gguf.GGUFWriter(OUT / "gguf-tiny.gguf", arch="llama")
    tokens, types, merges = tokenizer()
    w.add_name("wgrad tiny llama fixture")
    w.add_file_type(0)
    w.add_quantization_version(2)
    w.add_context_length(64)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(1)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV_HEAD)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    for key, value, vtype in SCALARS:
        w.add_key_value(key, value, vtype)
    for key, value, vtype in ARRAYS:
        w.add_key_value(key, value, V.ARRAY, sub_type=vtype)
    nested = {}
    for key, value in NESTED:
        w.add_key_value(key, value, V.ARRAY)
        nested[key] = value

    refs = {}
    randn = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    vocab = len(tokens)
    # The Llama block. q and k are made in Hugging Face's row order and
    # permuted as the converter does; `hf.*` keeps the de-quantized values
    # in Hugging Face's order. Quantization runs along rows (32-value blocks
    # of one row), so it commutes with a permutation of whole rows.
    add_tensor(w, refs, "token_embd.weight", randn(vocab, N_EMBD), Q.Q8_0)
    add_tensor(w, refs, "blk.0.attn_norm.weight", 1 + 0.1 * randn(N_EMBD), Q.F32)
    q_hf = randn(N_EMBD, N_EMBD)
    add_tensor(w, refs, "blk.0.attn_q.weight", permute(q_hf, N_HEAD, N_HEAD), Q.F32)
    refs["hf.model.layers.0.self_attn.q_proj.weight"] = q_hf
    k_hf = randn(N_KV_HEAD * HEAD_DIM, N_EMBD)
    add_tensor(w, refs, "blk.0.attn_k.weight", permute(k_hf, N_HEAD, N_KV_HEAD), Q.Q4_1)
    refs["hf.model.layers.0.self_attn.k_proj.weight"] = np.ascontiguousarray(
        gguf.quants.dequantize(quantize(k_hf, Q.Q4_1), Q.Q4_1).reshape(k_hf.shape))
    assert np.array_equal(permute(refs["hf.model.layers.0.self_attn.k_proj.weight"], N_HEAD, N_KV_HEAD), refs["blk.0.attn_k.weight"])
    add_tensor(w, refs, "blk.0.attn_v.weight", randn(N_KV_HEAD * HEAD_DIM, N_EMBD), Q.Q4_0)
    add_tensor(w, refs, "blk.0.attn_output.weight", randn(N_EMBD, N_EMBD), Q.F16)
    add_tensor(w, refs, "blk.0.ffn_norm.weight", 1 + 0.1 * randn(N_EMBD), Q.F32)
    add_tensor(w, refs, "blk.0.ffn_gate.weight", randn(N_FF, N_EMBD), Q.Q4_1)
    add_tensor(w, refs, "blk.0.ffn_up.weight", randn(N_FF, N_EMBD), Q.BF16)
    add_tensor(w, refs, "blk.0.ffn_down.weight", randn(N_EMBD, N_FF), Q.Q8_0)
    add_tensor(w, refs, "output_norm.weight", 1 + 0.1 * randn(N_EMBD), Q.F32)

    # Odd shapes of every decoded type.
    add_tensor(w, refs, "test.f32.one", randn(1), Q.F32)
    add_tensor(w, refs, "test.f32.prime", randn(13), Q.F32)
    add_tensor(w, refs, "test.f32.rank4", randn(2, 3, 5, 7), Q.F32)
    f16 = randn(7, 11)
    f16.reshape(-1)[:10] = special_f16()
    add_tensor(w, refs, "test.f16.odd", f16, Q.F16)
    add_tensor(w, refs, "test.f16.one", randn(1), Q.F16)
    bf16 = randn(3, 17)
    bf16.reshape(-1)[:10] = special_bf16()
    add_tensor(w, refs, "test.bf16.odd", bf16, Q.BF16)
    add_tensor(w, refs, "test.bf16.prime", randn(5), Q.BF16)
    for qtype in (Q.Q8_0, Q.Q4_0, Q.Q4_1):
        n = qtype.name.lower()
        add_tensor(w, refs, f"test.{n}.one_block", randn(1, 32), qtype)
        add_tensor(w, refs, f"test.{n}.prime_rows", 3 * randn(7, 96), qtype)
        add_tensor(w, refs, f"test.{n}.rank3", randn(3, 2, 64), qtype)
        const = np.full((2, 64), 0.75, dtype=np.float32)
        const[1] = 0.0
        add_tensor(w, refs, f"test.{n}.constant", const, qtype)
    # A valid Q5_K tensor (2 rows of one 256-value super-block each): its
    # bytes are random (a Q5_K block has no invalid bit pattern).
    q5k = rng.integers(0, 256, size=(2, 176), dtype=np.uint8)
    w.add_tensor("test.q5_k.unsupported", q5k, raw_shape=q5k.shape, raw_dtype=Q.Q5_K)
    save("gguf-tiny", w, refs, nested)


def align64():
    w = gguf.GGUFWriter(OUT / "gguf-align64.gguf", arch="llama")
    w.add_custom_alignment(64)
    w.add_string("wgrad.test.string", "aligned to 64")
    refs = {}
    add_tensor(w, refs, "test.f32.three", rng.standard_normal(3).astype(np.float32), Q.F32)
    add_tensor(w, refs, "test.q8_0.two_rows", rng.standard_normal((2, 32)).astype(np.float32), Q.Q8_0)
    add_tensor(w, refs, "test.f16.five", rng.standard_normal(5).astype(np.float32), Q.F16)
    save("gguf-align64", w, refs, {})


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    tiny()
    align64()
