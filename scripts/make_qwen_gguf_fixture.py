#!/usr/bin/env python3
"""Writes tests/fixtures/gguf-qwen2.gguf and gguf-qwen3.gguf: the tiny
Hugging Face folders of scripts/make_qwen_fixture.py (hf-tiny-qwen2,
hf-tiny-qwen3) converted the way llama.cpp's convert_hf_to_gguf.py
converts Qwen2/Qwen3 models: the `qwen2.*` / `qwen3.*` metadata keys
(`attention.key_length` and `value_length` for Qwen3's head width), the
tensor names of gguf-py's constants (`blk.N.attn_q.bias`,
`blk.N.attn_q_norm.weight`, …), q and k rows left in Hugging Face's order
(Qwen rotates in NEOX mode), no `output.weight` for a tied head, and a
37-token vocabulary (printable characters, `gpt2` model, `qwen2` pre).
Every tensor is F32, so the file's logits are the folder's:
tests/suite/qwen_folder.rs compares both with transformers'
(hf-tiny-qwen-logits.safetensors).

Needs `pip install gguf numpy safetensors`:
    python3 scripts/make_qwen_gguf_fixture.py
"""

import json
import pathlib

import gguf
import numpy as np
from safetensors.numpy import load_file

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"

# Hugging Face module names to gguf-py's (MODEL_TENSOR names for qwen2/qwen3).
BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
MODEL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}


def gguf_name(name):
    if name in MODEL:
        return MODEL[name]
    layer, rest = name.removeprefix("model.layers.").split(".", 1)
    module, suffix = rest.rsplit(".", 1)
    return f"blk.{layer}.{BLOCK[module]}.{suffix}"


def convert(arch):
    folder = ROOT / f"hf-tiny-{arch}"
    config = json.loads((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    w = gguf.GGUFWriter(ROOT / f"gguf-{arch}.gguf", arch=arch)
    w.add_name(f"wgrad tiny {arch} fixture")
    w.add_file_type(0)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "qwen3":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    tokens = [chr(ord("!") + i) for i in range(config["vocab_size"])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.NORMAL] * len(tokens))
    w.add_token_merges([])
    for name in sorted(tensors, key=lambda n: (n.count("layers"), n)):
        if config["tie_word_embeddings"] and name == "lm_head.weight":
            continue
        w.add_tensor(gguf_name(name), tensors[name].astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote gguf-{arch}.gguf")


if __name__ == "__main__":
    for arch in ["qwen2", "qwen3"]:
        convert(arch)
