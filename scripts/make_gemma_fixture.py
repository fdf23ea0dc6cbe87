#!/usr/bin/env python3
"""Writes the Hugging Face Gemma 3 folder fixture of
tests/suite/gemma_folder.rs, as scripts/make_qwen_fixture.py does for
Qwen: a tiny random Gemma3ForCausalLM (vocab 37, 16 positions, 3 layers,
local/global/local, 4 heads of 12 over 2 KV heads on 32 channels, MLP 56,
query_pre_attn_scalar 10, tied head), saved by transformers itself:

  tests/fixtures/hf-tiny-gemma3/   float32, one model.safetensors
  tests/fixtures/hf-tiny-gemma3-logits.safetensors
      ids [2, 16] (token ids stored as float32, exact) and its logits
      [2, 16, 37] (`gemma3`).

Every parameter gets noise on top of the init, so norm weights are not
the zeros that would hide a mix-up of names.

    python3 scripts/make_gemma_fixture.py

The other direction, a folder wgrad writes opened by transformers:

    cargo run --release --example hf_folder -- gemma3 out/gemma3-folder
    python3 scripts/check_hf_folder.py out/gemma3-folder
"""

import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = Gemma3TextConfig(
        vocab_size=37, hidden_size=32, intermediate_size=56, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=16, rms_norm_eps=1e-6, query_pre_attn_scalar=10,
        sliding_window=16, sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    model = Gemma3ForCausalLM._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.contiguous()
    shutil.rmtree(ROOT / "hf-tiny-gemma3", ignore_errors=True)
    model.save_pretrained(ROOT / "hf-tiny-gemma3")
    save_file({"ids": ids.float().contiguous(), "gemma3": logits}, ROOT / "hf-tiny-gemma3-logits.safetensors",
              metadata={"format": "pt", "source": "scripts/make_gemma_fixture.py"})
    print("wrote hf-tiny-gemma3 and hf-tiny-gemma3-logits.safetensors;", config.layer_types, config.rope_parameters)


if __name__ == "__main__":
    main()
