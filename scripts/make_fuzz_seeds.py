#!/usr/bin/env python3
"""Writes the seed inputs of the fuzz targets that need made-up files
(fuzz/seeds/<target>/; the gguf target's seeds are tests/fixtures' GGUF
files as they are):

  fuzz/seeds/hf_folder/*.bundle
      tiny GPT-2 and Llama folders (1 layer, 4 channels) in the bundle
      format of fuzz/fuzz_targets/hf_folder.rs (each file is `\\0FILE:NAME\\n`
      then its bytes): F32 in one file, F16 in two shards with an index,
      BF16, F64, a char tokenizer, and AdamW state in optimizer.safetensors,
      each of which loads; and two configs of 65,536 layers whose weights
      are far too small, which must be refused before allocating; and
      tests/fixtures' tiny Gemma 3, Qwen2, Qwen3 and Mistral folders.
  fuzz/seeds/tokenizer/tiny-bpe.gguf
      a GGUF holding only tests/fixtures/gguf-tiny.gguf's tokenizer
      metadata (scripts/make_gguf_fixture.py's tokenizer and template);
      beside it tests/fixtures/tokenizers' spm-llama, spm-gemma3 and
      qwen2-bpe files as they are.

  fuzz/seeds/gguf/gemma3-every-format.gguf
      a tiny Gemma 3 (2 blocks, 256 channels, 2 heads over 1 KV head of
      width 32, MLP 64) whose 15 matrices cover every block format the
      kernels read: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q5_0, Q5_1, IQ4_NL, Q8_0,
      and BF16/F16 (random blocks, finite scales), a SentencePiece-style
      vocabulary; it loads. Beside it the same file broken as issue 37
      lists: a k-quant tensor cut short, a row that is not whole
      super-blocks, a NaN and an infinite scale, a family's tensor
      missing, one misshapen; and the Qwen2 and Qwen3 fixtures each
      missing what sets their family apart (a q bias, a q norm), each must
      be a clear error (tests/suite/fuzz_seeds.rs says which); and the
      Qwen2, Qwen3 and Mistral fixtures as they are.

Needs numpy and gguf (`pip install gguf numpy`):
    python3 scripts/make_fuzz_seeds.py
"""

import json
import pathlib
import shutil
import sys

import numpy as np
import gguf

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fuzz" / "seeds"
sys.path.insert(0, str(ROOT / "scripts"))
from make_gguf_fixture import CHAT_TEMPLATE, tokenizer  # noqa: E402

rng = np.random.default_rng(6)
V, T, C, HEADS, KV_HEADS, FF = 5, 3, 4, 2, 1, 3


def safetensors(tensors, dtype="F32", metadata=None):
    """The safetensors bytes of `tensors` (name → float32 array) stored as
    `dtype` (8-byte header length, JSON header, data)."""
    header, blobs, offset = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name in sorted(tensors):
        x = np.ascontiguousarray(tensors[name], dtype="<f4")
        if dtype == "BF16":
            data = (x.view("<u4") >> 16).astype("<u2").tobytes()
        else:
            data = x.astype({"F32": "<f4", "F16": "<f2", "F64": "<f8"}[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def bundle(name, files):
    out = b"".join(b"\0FILE:" + n.encode() + b"\n" + data for n, data in files.items())
    (SEEDS / "hf_folder" / f"{name}.bundle").write_bytes(out)


def w(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def gpt2():
    config = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": V, "n_positions": T, "n_embd": C,
              "n_head": HEADS, "n_layer": 1, "n_inner": None, "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
              "tie_word_embeddings": True}
    p = {"wte.weight": w(V, C), "wpe.weight": w(T, C), "ln_f.weight": w(C), "ln_f.bias": w(C)}
    for ln in ("ln_1", "ln_2"):
        p[f"h.0.{ln}.weight"], p[f"h.0.{ln}.bias"] = w(C), w(C)
    # Conv1D matrices are stored [in, out].
    for module, n_in, n_out in (("attn.c_attn", C, 3 * C), ("attn.c_proj", C, C), ("mlp.c_fc", C, 4 * C), ("mlp.c_proj", 4 * C, C)):
        p[f"h.0.{module}.weight"], p[f"h.0.{module}.bias"] = w(n_in, n_out), w(n_out)
    return json.dumps(config).encode(), {f"transformer.{k}": v for k, v in p.items()}


def llama():
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": V, "max_position_embeddings": T,
              "hidden_size": C, "intermediate_size": FF, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "num_hidden_layers": 1, "rms_norm_eps": 1e-5, "hidden_act": "silu", "tie_word_embeddings": False,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}
    kv = KV_HEADS * C // HEADS
    l = "model.layers.0"
    p = {"model.embed_tokens.weight": w(V, C), "model.norm.weight": w(C), "lm_head.weight": w(V, C),
         f"{l}.input_layernorm.weight": w(C), f"{l}.post_attention_layernorm.weight": w(C),
         f"{l}.self_attn.q_proj.weight": w(C, C), f"{l}.self_attn.k_proj.weight": w(kv, C),
         f"{l}.self_attn.v_proj.weight": w(kv, C), f"{l}.self_attn.o_proj.weight": w(C, C),
         f"{l}.mlp.gate_proj.weight": w(FF, C), f"{l}.mlp.up_proj.weight": w(FF, C), f"{l}.mlp.down_proj.weight": w(C, FF)}
    return json.dumps(config).encode(), p


def sharded(config, p, dtype):
    names = sorted(p)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    index = {"metadata": {}, "weight_map": {n: f for f, ns in shards.items() for n in ns}}
    files = {"config.json": config, "model.safetensors.index.json": json.dumps(index).encode()}
    files.update({f: safetensors({n: p[n] for n in ns}, dtype) for f, ns in shards.items()})
    return files


def hf_folder():
    (SEEDS / "hf_folder").mkdir(parents=True, exist_ok=True)
    config, p = gpt2()
    char = json.dumps({"kind": "char", "vocabulary": "abcde"}).encode()
    bundle("gpt2-f32", {"config.json": config, "model.safetensors": safetensors(p), "wgrad_tokenizer.json": char})
    bundle("gpt2-f16-sharded", sharded(config, p, "F16"))
    config, p = llama()
    # AdamW's moments under the module tree's names, as save_llama_folder_with_state writes them.
    moments = {f"{n}.{s}": w(*x.shape) for n, x in p.items() for s in ("exp_avg", "exp_avg_sq")}
    meta = {"format": "wgrad-optimizer", "optimizer": "adamw", "step": "3", "state_names": "exp_avg,exp_avg_sq"}
    bundle("llama-f32", {"config.json": config, "model.safetensors": safetensors(p), "wgrad_tokenizer.json": char,
                         "optimizer.safetensors": safetensors(moments, metadata=meta)})
    bundle("llama-bf16", {"config.json": config, "model.safetensors": safetensors(p, "BF16")})
    bundle("llama-f64-sharded", sharded(config, p, "F64"))
    # Sizes within config.json's limits that the weights cannot hold (an
    # empty model of them allocated over a gigabyte of norms).
    absurd = {**json.loads(config), "num_hidden_layers": 65536, "hidden_size": 2880, "num_attention_heads": 1440, "intermediate_size": 1}
    bundle("llama-65536-layers", {"config.json": json.dumps(absurd).encode(), "model.safetensors": safetensors(p)})
    config, p = gpt2()
    absurd = {**json.loads(config), "n_layer": 65536, "n_embd": 1180, "n_head": 1}
    bundle("gpt2-65536-layers", {"config.json": json.dumps(absurd).encode(), "model.safetensors": safetensors(p)})
    # The families' tiny folders of tests/fixtures (what transformers'
    # save_pretrained wrote), as they are.
    for family in ["gemma3", "qwen2", "qwen3", "mistral"]:
        folder = ROOT / "tests" / "fixtures" / f"hf-tiny-{family}"
        bundle(f"{family}-f32", {n: (folder / n).read_bytes() for n in ["config.json", "model.safetensors"]})


def tokenizer_gguf():
    (SEEDS / "tokenizer").mkdir(parents=True, exist_ok=True)
    path = SEEDS / "tokenizer" / "tiny-bpe.gguf"
    writer = gguf.GGUFWriter(path, arch="llama")
    tokens, types, merges = tokenizer()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # The families' vocabularies (scripts/tokenizer_fixtures.py): SentencePiece
    # as Llama 2 and as Gemma 3 lay it out, byte-level BPE under Qwen2's pre.
    for name in ["spm-llama.gguf", "spm-gemma3.gguf", "qwen2-bpe.gguf"]:
        shutil.copy(ROOT / "tests" / "fixtures" / "tokenizers" / name, SEEDS / "tokenizer" / name)


# The Gemma 3 seed's matrices: (name, rows, columns, type), the types
# spread so every format the kernels read is some matrix's.
G_C, G_HEADS, G_HEAD_DIM, G_FF, G_VOCAB = 256, 2, 32, 64, 16
GEMMA_MATRICES = [
    ("attn_q", G_HEADS * G_HEAD_DIM, G_C, [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K]),
    ("attn_k", G_HEAD_DIM, G_C, [gguf.GGMLQuantizationType.Q5_K, gguf.GGMLQuantizationType.BF16]),
    ("attn_v", G_HEAD_DIM, G_C, [gguf.GGMLQuantizationType.Q6_K, gguf.GGMLQuantizationType.F16]),
    ("attn_output", G_C, G_HEADS * G_HEAD_DIM, [gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1]),
    ("ffn_down", G_C, G_FF, [gguf.GGMLQuantizationType.IQ4_NL, gguf.GGMLQuantizationType.Q8_0]),
    ("ffn_gate", G_FF, G_C, [gguf.GGMLQuantizationType.Q2_K, gguf.GGMLQuantizationType.Q4_K]),
    ("ffn_up", G_FF, G_C, [gguf.GGMLQuantizationType.Q3_K, gguf.GGMLQuantizationType.Q2_K]),
]
GEMMA_NORMS = [("attn_norm", G_C), ("attn_q_norm", G_HEAD_DIM), ("attn_k_norm", G_HEAD_DIM),
               ("post_attention_norm", G_C), ("ffn_norm", G_C), ("post_ffw_norm", G_C)]
# Byte offsets of each format's f16 scales within its block (as
# scripts/make_kquant_fixture.py): kept finite in the loading seed.
SCALES = {"Q8_0": [0], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0], "Q2_K": [80, 82], "Q3_K": [108],
          "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208]}


def random_blocks(grng, ty, rows, cols):
    """rows × cols values of `ty` as random blocks, every f16 scale finite."""
    if ty in (gguf.GGMLQuantizationType.BF16, gguf.GGMLQuantizationType.F16):
        values = (grng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        return gguf.quants.quantize(values, ty), values.shape
    block, size = gguf.GGML_QUANT_SIZES[ty]
    blocks = grng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for at in SCALES[ty.name]:
        hi = blocks[:, at + 1]
        blocks[:, at + 1] = np.where((hi & 0x7C) == 0x7C, hi & ~np.uint8(0x40), hi)
    return blocks.reshape(rows, -1), (rows, cols)


def gemma3_gguf(path, drop=None, misshapen=None):
    """The tiny Gemma 3 of every format, without the tensor `drop`, or
    with `misshapen` given 16 rows more."""
    grng = np.random.default_rng(37)
    w = gguf.GGUFWriter(str(path), arch="gemma3")
    w.add_name("wgrad fuzz seed: a tiny Gemma 3 in every format")
    w.add_context_length(64)
    w.add_embedding_length(G_C)
    w.add_block_count(2)
    w.add_feed_forward_length(G_FF)
    w.add_head_count(G_HEADS)
    w.add_head_count_kv(1)
    w.add_key_length(G_HEAD_DIM)
    w.add_value_length(G_HEAD_DIM)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(8)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>"] + ["\u2581" + c for c in "abcdef"] + list("abcdef")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(len(tokens) - 4)])
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.NORMAL] * 12)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    embd, _ = random_blocks(grng, gguf.GGMLQuantizationType.Q8_0, G_VOCAB, G_C)
    w.add_tensor("token_embd.weight", embd, raw_shape=embd.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    for layer in range(2):
        for norm, n in GEMMA_NORMS:
            w.add_tensor(f"blk.{layer}.{norm}.weight", (1.0 + 0.1 * grng.standard_normal(n)).astype(np.float32))
        for name, rows, cols, types in GEMMA_MATRICES:
            full = f"blk.{layer}.{name}.weight"
            if full == drop:
                continue
            rows += 16 if full == misshapen else 0
            raw, _ = random_blocks(grng, types[layer], rows, cols)
            w.add_tensor(full, raw, raw_shape=raw.shape, raw_dtype=types[layer])
    w.add_tensor("output_norm.weight", (1.0 + 0.1 * grng.standard_normal(G_C)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tensor_info_at(data, name):
    """The offset of tensor `name`'s info in a GGUF header: its n_dims
    (u32), then its dims (u64 each), its type (u32), its offset (u64)."""
    key = len(name).to_bytes(8, "little") + name.encode()
    at = data.index(key) + len(key)
    return at


def tensor_data(data, name):
    """(offset in the file, bytes) of tensor `name`'s data."""
    r = gguf.GGUFReader(io_bytes(data))
    t = next(t for t in r.tensors if t.name == name)
    return t.data_offset, t.n_bytes


def io_bytes(data):
    path = SEEDS / "gguf" / ".scratch.gguf"
    path.write_bytes(data)
    return str(path)


def gguf_seeds():
    out = SEEDS / "gguf"
    good = out / "gemma3-every-format.gguf"
    gemma3_gguf(good)
    data = good.read_bytes()
    # A Q4_K tensor (blk.0.attn_q, 64 × 256) read as 128 × 128: the same
    # values, but a row of 128 is half a super-block.
    at = tensor_info_at(data, "blk.0.attn_q.weight")
    broken = bytearray(data)
    broken[at + 4:at + 20] = (128).to_bytes(8, "little") * 2
    (out / "gemma3-q4k-row-half-a-super-block.gguf").write_bytes(broken)
    # NaN d of the first Q4_K block, infinite d of a Q6_K block (at byte
    # 208 of its 210) and an infinite dmin of a Q2_K block.
    for name, ty, scale, bits, what in [
        ("blk.0.attn_q.weight", "Q4_K", 0, 0x7E00, "nan-d"),
        ("blk.0.attn_v.weight", "Q6_K", 208, 0x7C00, "inf-d"),
        ("blk.0.ffn_gate.weight", "Q2_K", 82, 0xFC00, "inf-dmin"),
    ]:
        start, _ = tensor_data(data, name)
        broken = bytearray(data)
        broken[start + scale:start + scale + 2] = bits.to_bytes(2, "little")
        (out / f"gemma3-{ty.lower().replace('_', '')}-{what}.gguf").write_bytes(broken)
    # Cut inside the last tensor's last super-block (blk.1.ffn_up, Q2_K:
    # 84-byte blocks).
    start, n = tensor_data(data, "blk.1.ffn_up.weight")
    (out / "gemma3-q2k-cut-short.gguf").write_bytes(data[:start + n - 50])
    gemma3_gguf(out / "gemma3-missing-ffn-up.gguf", drop="blk.1.ffn_up.weight")
    gemma3_gguf(out / "gemma3-misshapen-attn-k.gguf", misshapen="blk.0.attn_k.weight")
    (out / ".scratch.gguf").unlink()
    # The Qwen fixtures without what makes them Qwen: the name changed in
    # place (same length), so the file stays well-formed.
    for arch, name, other, what in [("qwen2", "blk.0.attn_q.bias", "blk.0.attn_x.bias", "no-q-bias"),
                                    ("qwen3", "blk.1.attn_q_norm.weight", "blk.1.attn_x_norm.weight", "no-q-norm")]:
        data = (ROOT / "tests" / "fixtures" / f"gguf-{arch}.gguf").read_bytes()
        (out / f"{arch}.gguf").write_bytes(data)
        at = data.index(name.encode())
        (out / f"{arch}-{what}.gguf").write_bytes(data[:at] + other.encode() + data[at + len(name):])
    shutil.copy(ROOT / "tests" / "fixtures" / "gguf-mistral.gguf", out / "mistral.gguf")

if __name__ == "__main__":
    hf_folder()
    tokenizer_gguf()
    gguf_seeds()
    for p in sorted(SEEDS.glob("*/*")):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")
