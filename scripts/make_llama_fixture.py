#!/usr/bin/env python3
"""Writes the Hugging Face Llama fixtures of tests/suite/llama_folder.rs,
as scripts/make_hf_fixture.py does for GPT-2.

A tiny random LlamaForCausalLM (vocab 37, 16 positions, 2 layers, 4 heads
over 2 KV heads, 32 channels, MLP 56, untied head), saved by transformers
itself, so the Rust tests read exactly what `save_pretrained` writes:

  tests/fixtures/hf-tiny-llama/          float32, one model.safetensors
  tests/fixtures/hf-tiny-llama-sharded/  float32, shards + model.safetensors.index.json
  tests/fixtures/hf-tiny-llama-bf16/     bfloat16, one model.safetensors
  tests/fixtures/hf-tiny-llama-logits.safetensors
      ids [2, 16] (token ids stored as float32, exact), and the logits
      [2, 16, 37] of the float32 model (`logits`) and of the bfloat16
      weights run in float32 (`logits_bf16`).

Every parameter gets noise on top of the init, so the RMSNorm weights are
not the ones that would hide a mix-up of names.

    python3 scripts/make_llama_fixture.py
"""

import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main():
    # One thread: the same logits bytes on every run.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=37, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))

    ids = torch.randint(0, config.vocab_size, (2, config.max_position_embeddings), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits

    for name in ["hf-tiny-llama", "hf-tiny-llama-sharded", "hf-tiny-llama-bf16"]:
        shutil.rmtree(ROOT / name, ignore_errors=True)
    model.save_pretrained(ROOT / "hf-tiny-llama")
    # About 40 KB of weights in shards of at most 16 KB: several files.
    model.save_pretrained(ROOT / "hf-tiny-llama-sharded", max_shard_size="16KB")
    half = LlamaForCausalLM._from_config(config, attn_implementation="eager").eval()
    half.load_state_dict(model.state_dict())
    half = half.to(torch.bfloat16)
    half.save_pretrained(ROOT / "hf-tiny-llama-bf16")
    # The bfloat16 weights widened into a float32 model: `half.float()`
    # would also carry the rotary frequencies' bfloat16 rounding, which no
    # stored tensor holds.
    widened = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    widened.load_state_dict({n: v.float() for n, v in half.state_dict().items()})
    with torch.no_grad():
        logits_bf16 = widened(ids, use_cache=False).logits

    save_file(
        {"ids": ids.float().contiguous(), "logits": logits.contiguous(), "logits_bf16": logits_bf16.contiguous()},
        ROOT / "hf-tiny-llama-logits.safetensors",
        metadata={"format": "pt", "source": "scripts/make_llama_fixture.py"},
    )
    print("max |logits - logits_bf16|:", (logits - logits_bf16).abs().max().item())


if __name__ == "__main__":
    main()
