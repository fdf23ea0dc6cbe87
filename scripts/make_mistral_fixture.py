#!/usr/bin/env python3
"""Writes the Hugging Face Mistral folder fixture of
tests/suite/mistral_folder.rs, as scripts/make_qwen_fixture.py does for
Qwen: a tiny random MistralForCausalLM (vocab 37, 16 positions, 2 layers,
4 heads of 12 channels over 2 KV heads (not 32 / 4), 32 channels, MLP 56,
untied head) attending over a sliding window of 5 positions, saved by
transformers itself:

  tests/fixtures/hf-tiny-mistral/   float32, one model.safetensors
  tests/fixtures/hf-tiny-mistral-logits.safetensors
      ids [2, 16] (token ids stored as float32, exact) and the logits
      [2, 16, 37] (`mistral`), and the same model's without the window
      (`mistral_full`), which the test shows differ.

Every parameter gets noise on top of the init, so norm weights are not the
ones that would hide a mix-up of names.

    python3 scripts/make_mistral_fixture.py

The other direction, a folder wgrad writes opened by transformers:

    cargo run --release --example hf_folder -- mistral out/mistral-folder
    python3 scripts/check_hf_folder.py out/mistral-folder
"""

import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import MistralConfig, MistralForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
WINDOW = 5


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=37, hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=16, rope_theta=10000.0, rms_norm_eps=1e-6,
        sliding_window=WINDOW, tie_word_embeddings=False, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )
    model = MistralForCausalLM._from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    ids = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(1))
    tensors = {"ids": ids.float().contiguous()}
    with torch.no_grad():
        tensors["mistral"] = model(ids, use_cache=False).logits.contiguous()
        model.config.sliding_window = None
        full = MistralForCausalLM._from_config(model.config, attn_implementation="eager").float().eval()
        full.load_state_dict(model.state_dict())
        tensors["mistral_full"] = full(ids, use_cache=False).logits.contiguous()
        model.config.sliding_window = WINDOW
    effect = (tensors["mistral"] - tensors["mistral_full"]).abs().max().item()
    assert effect > 1e-3, f"the window must matter in this fixture ({effect})"
    shutil.rmtree(ROOT / "hf-tiny-mistral", ignore_errors=True)
    model.save_pretrained(ROOT / "hf-tiny-mistral")
    save_file(tensors, ROOT / "hf-tiny-mistral-logits.safetensors", metadata={"format": "pt", "source": "scripts/make_mistral_fixture.py"})
    print(f"wrote hf-tiny-mistral and hf-tiny-mistral-logits.safetensors; the window moves the logits by {effect:.3g}")


if __name__ == "__main__":
    main()
