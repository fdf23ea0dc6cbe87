#!/usr/bin/env python3
"""Writes the Hugging Face Qwen2 and Qwen3 folder fixtures of
tests/suite/qwen_folder.rs, as scripts/make_llama_fixture.py does for the
Llama: tiny random Qwen2ForCausalLM and Qwen3ForCausalLM (vocab 37, 16
positions, 2 layers, 4 heads over 2 KV heads, 32 channels, MLP 56; Qwen2
with q/k/v biases and a tied head, Qwen3 with q/k norms, heads of 12
channels and an untied head), saved by transformers itself:

  tests/fixtures/hf-tiny-qwen2/   float32, one model.safetensors
  tests/fixtures/hf-tiny-qwen3/   float32, one model.safetensors
  tests/fixtures/hf-tiny-qwen-logits.safetensors
      ids [2, 16] (token ids stored as float32, exact) and each model's
      logits [2, 16, 37] (`qwen2`, `qwen3`).

Every parameter gets noise on top of the init, so biases and norm weights
are not the zeros and ones that would hide a mix-up of names.

    python3 scripts/make_qwen_fixture.py

The other direction, a folder wgrad writes opened by transformers:

    cargo run --release --example hf_folder -- qwen3 out/qwen3-folder
    python3 scripts/check_hf_folder.py out/qwen3-folder
"""

import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def build(config_class, model_class, **extra):
    config = config_class(
        vocab_size=37, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        use_sliding_window=False, pad_token_id=None, bos_token_id=None, eos_token_id=None, **extra,
    )
    model = model_class._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    models = {
        "qwen2": build(Qwen2Config, Qwen2ForCausalLM, tie_word_embeddings=True),
        "qwen3": build(Qwen3Config, Qwen3ForCausalLM, tie_word_embeddings=False, head_dim=12),
    }
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    tensors = {"ids": ids.float().contiguous()}
    for name, model in models.items():
        with torch.no_grad():
            tensors[name] = model(ids, use_cache=False).logits.contiguous()
        shutil.rmtree(ROOT / f"hf-tiny-{name}", ignore_errors=True)
        model.save_pretrained(ROOT / f"hf-tiny-{name}")
    save_file(tensors, ROOT / "hf-tiny-qwen-logits.safetensors", metadata={"format": "pt", "source": "scripts/make_qwen_fixture.py"})
    print("wrote", ", ".join(f"hf-tiny-{name}" for name in models), "and hf-tiny-qwen-logits.safetensors")


if __name__ == "__main__":
    main()
