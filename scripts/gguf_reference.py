#!/usr/bin/env python3
"""Writes the GGUF model fixtures of tests/suite/gguf_model.rs: two tiny
random Llamas as llama.cpp's converter would write them, and what
transformers computes on them after loading them with `gguf_file=` (its
GGUF loader de-quantizes every tensor with `gguf.quants.dequantize` and
undoes the converter's q/k row permutation), so wgrad's GGUF loader is
checked end to end, rotary layout included, against code it shares nothing
with.

  tests/fixtures/gguf-llama.gguf
      2 blocks, 64 channels, 4 heads over 2 KV heads, MLP 96, context 32,
      RoPE base 10000, RMSNorm eps 1e-5, the tiny byte-level BPE of
      gguf-tiny.gguf (271 tokens); a Q4_0 token table and an untied Q4_1
      head (`output.weight`). Norms F32; the blocks' matrices spread over
      F32, F16, BF16, Q8_0, Q4_0 and Q4_1 so each type is a q, a k and
      another projection somewhere across the two files.
  tests/fixtures/gguf-llama-tied.gguf
      the same sizes with other weights and no `output.weight` (the head is
      the Q8_0 token table, as in SmolLM2's file).
  tests/fixtures/gguf-gpt2.gguf
      a tiny GPT-2 (2 blocks, 32 channels, 4 heads, MLP 128, context 32,
      LayerNorm eps 1e-5, the same tokenizer) as llama.cpp's converter
      writes one: Conv1D weights transposed to [out, in], biases and norms
      F32, the matrices spread over the quantized and float types, and
      `output.weight` a copy of the Q8_0 token table.
  tests/fixtures/gguf-llama-logits.safetensors
      `ids` [1, 32]: the token ids fed; `logits` / `logits_tied` [1, 32, 271]:
      transformers' float32 logits for them; `prompt` [5] and `greedy` /
      `greedy_tied` [12]: transformers' greedy continuation of the prompt
      (`generate(do_sample=False)`, KV cache on), each step's top-two
      margin checked here to be large enough that float32 rounding cannot
      flip it; `logits_gpt2` and `greedy_gpt2` the same for the GPT-2.
      Token ids are stored as float32 (exact below 2^24).

Needs the shared reference venv (torch, transformers 5, gguf, numpy):
    /work/venv-ref/bin/python scripts/gguf_reference.py
"""

import pathlib
import sys

import numpy as np
import gguf
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
# The tiny tokenizer, the converter's permutation and the tensor writer are
# the reader fixture's (scripts/make_gguf_fixture.py).
from make_gguf_fixture import CHAT_TEMPLATE, OUT, add_tensor, permute, save_safetensors, tokenizer  # noqa: E402

N_LAYER, N_EMBD, N_HEAD, N_KV_HEAD, N_FF, N_CTX = 2, 64, 4, 2, 96, 32
HEAD_DIM = N_EMBD // N_HEAD
KV = N_KV_HEAD * HEAD_DIM
# Weights N(0, STD²): wide enough that the logits spread over a few units
# (greedy steps have clear margins), small enough that nothing saturates.
STD = 0.25

# Each block's matrices and their types: every decoded type appears as a q
# (permuted rows), a k (permuted with the KV head count) and a plain
# projection somewhere across the two files.
TYPES_UNTIED = [
    {"attn_q": Q.F32, "attn_k": Q.F16, "attn_v": Q.BF16, "attn_output": Q.Q8_0, "ffn_gate": Q.Q4_0, "ffn_up": Q.Q4_1, "ffn_down": Q.Q8_0},
    {"attn_q": Q.Q4_1, "attn_k": Q.Q4_0, "attn_v": Q.Q8_0, "attn_output": Q.F16, "ffn_gate": Q.BF16, "ffn_up": Q.F32, "ffn_down": Q.Q4_1},
]
TYPES_TIED = [
    {"attn_q": Q.Q8_0, "attn_k": Q.BF16, "attn_v": Q.Q4_1, "attn_output": Q.Q4_0, "ffn_gate": Q.F16, "ffn_up": Q.Q8_0, "ffn_down": Q.F32},
    {"attn_q": Q.Q4_0, "attn_k": Q.Q8_0, "attn_v": Q.F16, "attn_output": Q.BF16, "ffn_gate": Q.Q4_1, "ffn_up": Q.Q4_0, "ffn_down": Q.F16},
]
SHAPES = {
    "attn_q": (N_EMBD, N_EMBD),
    "attn_k": (KV, N_EMBD),
    "attn_v": (KV, N_EMBD),
    "attn_output": (N_EMBD, N_EMBD),
    "ffn_gate": (N_FF, N_EMBD),
    "ffn_up": (N_FF, N_EMBD),
    "ffn_down": (N_EMBD, N_FF),
}
# A whole context of ids (wgrad's Predictor runs full blocks), so every
# rotary position is checked; the BOS first, as a tokenizer would put it.
IDS = [1] + np.random.default_rng(7).integers(0, 271, N_CTX - 1).tolist()
PROMPT = [1, 84, 104, 101, 260]
NEW_TOKENS = 12
# Smallest top-two logit gap accepted at a greedy step: wgrad's float32
# logits differ from torch's by ~1e-5, far below this.
MIN_MARGIN = 1e-3


def add_tokenizer(w, tokens, token_types, merges, pre):
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)


def finish(w, stem):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = OUT / f"{stem}.gguf"
    print(f"{path}: {path.stat().st_size} bytes")
    return path


def write_model(stem, seed, types, tied):
    rng = np.random.default_rng(seed)
    randn = lambda *shape: (STD * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    tokens, token_types, merges = tokenizer()
    w = gguf.GGUFWriter(OUT / f"{stem}.gguf", arch="llama")
    w.add_name(f"wgrad {stem} fixture")
    w.add_quantization_version(2)
    w.add_context_length(N_CTX)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_KV_HEAD)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(w, tokens, token_types, merges, "smollm")
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template(CHAT_TEMPLATE)
    refs = {}
    vocab = len(tokens)
    add_tensor(w, refs, "token_embd.weight", 4 * randn(vocab, N_EMBD), Q.Q8_0 if tied else Q.Q4_0)
    for i, layer_types in enumerate(types):
        add_tensor(w, refs, f"blk.{i}.attn_norm.weight", 1 + randn(N_EMBD), Q.F32)
        add_tensor(w, refs, f"blk.{i}.ffn_norm.weight", 1 + randn(N_EMBD), Q.F32)
        for module, qtype in layer_types.items():
            values = randn(*SHAPES[module])
            # Made in Hugging Face's row order, stored in the converter's.
            if module == "attn_q":
                values = permute(values, N_HEAD, N_HEAD)
            elif module == "attn_k":
                values = permute(values, N_HEAD, N_KV_HEAD)
            add_tensor(w, refs, f"blk.{i}.{module}.weight", values, qtype)
    add_tensor(w, refs, "output_norm.weight", 1 + randn(N_EMBD), Q.F32)
    if not tied:
        add_tensor(w, refs, "output.weight", randn(vocab, N_EMBD), Q.Q4_1)
    return finish(w, stem)


GPT2_EMBD, GPT2_HEAD = 32, 4
GPT2_TYPES = [
    {"attn_qkv": Q.Q4_1, "attn_output": Q.F16, "ffn_up": Q.Q8_0, "ffn_down": Q.BF16},
    {"attn_qkv": Q.Q4_0, "attn_output": Q.Q8_0, "ffn_up": Q.F32, "ffn_down": Q.Q4_1},
]


def write_gpt2(stem, seed):
    rng = np.random.default_rng(seed)
    randn = lambda *shape: (STD * rng.standard_normal(shape)).astype(np.float32)  # noqa: E731
    tokens, token_types, merges = tokenizer()
    c = GPT2_EMBD
    w = gguf.GGUFWriter(OUT / f"{stem}.gguf", arch="gpt2")
    w.add_name(f"wgrad {stem} fixture")
    w.add_quantization_version(2)
    w.add_context_length(N_CTX)
    w.add_embedding_length(c)
    w.add_block_count(N_LAYER)
    w.add_feed_forward_length(4 * c)
    w.add_head_count(GPT2_HEAD)
    w.add_layer_norm_eps(1e-5)
    add_tokenizer(w, tokens, token_types, merges, "gpt-2")
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    refs = {}
    vocab = len(tokens)
    embedding = 4 * randn(vocab, c)
    add_tensor(w, refs, "token_embd.weight", embedding, Q.Q8_0)
    add_tensor(w, refs, "position_embd.weight", randn(N_CTX, c), Q.F32)
    # (transformers 5 reads `gpt2.context_length` into n_ctx but sizes the
    # position table by n_positions: reference() passes n_positions.)
    # [out, in], as the converter stores GPT-2's Conv1D weights transposed.
    shapes = {"attn_qkv": (3 * c, c), "attn_output": (c, c), "ffn_up": (4 * c, c), "ffn_down": (c, 4 * c)}
    for i, layer_types in enumerate(GPT2_TYPES):
        for norm in ("attn_norm", "ffn_norm"):
            add_tensor(w, refs, f"blk.{i}.{norm}.weight", 1 + randn(c), Q.F32)
            add_tensor(w, refs, f"blk.{i}.{norm}.bias", randn(c), Q.F32)
        for module, qtype in layer_types.items():
            add_tensor(w, refs, f"blk.{i}.{module}.weight", randn(*shapes[module]), qtype)
            add_tensor(w, refs, f"blk.{i}.{module}.bias", randn(shapes[module][0]), Q.F32)
    add_tensor(w, refs, "output_norm.weight", 1 + randn(c), Q.F32)
    add_tensor(w, refs, "output_norm.bias", randn(c), Q.F32)
    # The converter writes the tied head again under its own name.
    add_tensor(w, refs, "output.weight", embedding, Q.Q8_0)
    return finish(w, stem)


def reference(path, tied, **config):
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32, **config)
    model.eval()
    config = model.config
    if config.model_type == "llama":
        assert config.tie_word_embeddings == tied, config
        assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (N_LAYER, N_EMBD, N_HEAD, N_KV_HEAD), config
    else:
        assert (config.n_layer, config.n_embd, config.n_head, config.n_ctx) == (N_LAYER, GPT2_EMBD, GPT2_HEAD, N_CTX), config
    with torch.no_grad():
        logits = model(torch.tensor([IDS])).logits.float().numpy()
        out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    greedy = out.sequences[0, len(PROMPT):].numpy()
    for step, step_logits in enumerate(out.logits):
        top = torch.topk(step_logits[0].float(), 2).values
        margin = float(top[0] - top[1])
        assert margin > MIN_MARGIN, f"{path.name}: greedy step {step} has a margin of {margin}; choose other weights"
    print(f"{path.name}: logits in [{logits.min():.2f}, {logits.max():.2f}], greedy {greedy.tolist()}")
    return logits, greedy


def main():
    torch.manual_seed(0)
    untied = write_model("gguf-llama", 2501, TYPES_UNTIED, tied=False)
    tied = write_model("gguf-llama-tied", 2502, TYPES_TIED, tied=True)
    logits, greedy = reference(untied, tied=False)
    logits_tied, greedy_tied = reference(tied, tied=True)
    logits_gpt2, greedy_gpt2 = reference(write_gpt2("gguf-gpt2", 2503), tied=True, n_positions=N_CTX)
    f32 = lambda v: np.asarray(v, dtype=np.float32)  # noqa: E731
    save_safetensors(
        {
            "ids": f32([IDS]),
            "logits": logits,
            "logits_tied": logits_tied,
            "prompt": f32(PROMPT),
            "greedy": f32(greedy),
            "greedy_tied": f32(greedy_tied),
            "logits_gpt2": logits_gpt2,
            "greedy_gpt2": f32(greedy_gpt2),
        },
        OUT / "gguf-llama-logits.safetensors",
    )


if __name__ == "__main__":
    main()
