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
      are far too small, which must be refused before allocating.
  fuzz/seeds/tokenizer/tiny-bpe.gguf
      a GGUF holding only tests/fixtures/gguf-tiny.gguf's tokenizer
      metadata (scripts/make_gguf_fixture.py's tokenizer and template).

Needs numpy and gguf (`pip install gguf numpy`):
    python3 scripts/make_fuzz_seeds.py
"""

import json
import pathlib
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


if __name__ == "__main__":
    hf_folder()
    tokenizer_gguf()
    for p in sorted(SEEDS.glob("*/*")):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")
