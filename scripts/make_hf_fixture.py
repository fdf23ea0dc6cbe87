#!/usr/bin/env python3
"""Writes the Hugging Face fixtures of tests/suite/gpt_folder.rs.

A tiny random GPT2LMHeadModel (vocab 37, 16 positions, 2 layers, 3 heads,
24 channels), saved by transformers itself, so the Rust tests read exactly
what `save_pretrained` writes:

  tests/fixtures/hf-tiny-gpt2/          float32, one model.safetensors
  tests/fixtures/hf-tiny-gpt2-sharded/  float32, model-0000N-of-0000M.safetensors
                                        with model.safetensors.index.json
  tests/fixtures/hf-tiny-gpt2-f16/      float16, one model.safetensors
  tests/fixtures/hf-tiny-gpt2-logits.safetensors
      ids [2, 16] (token ids stored as float32, exact), and the logits
      [2, 16, 37] of the float32 model (`logits`) and of the float16
      weights run in float32 (`logits_f16`).

Every parameter gets noise on top of GPT-2's init, so layer norms and
biases are not the ones and zeros that would hide a mix-up of names or a
missing transpose.

Run with the project's venv (torch, transformers, safetensors):
    /work/venv/bin/python scripts/make_hf_fixture.py
"""

import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import GPT2Config, GPT2LMHeadModel

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"


def main():
    # One thread: the same logits bytes on every run.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=37,
        n_positions=16,
        n_embd=24,
        n_layer=2,
        n_head=3,
        bos_token_id=36,
        eos_token_id=36,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(0.1 * torch.randn_like(p))

    ids = torch.randint(0, config.vocab_size, (2, config.n_positions), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits

    for name in ["hf-tiny-gpt2", "hf-tiny-gpt2-sharded", "hf-tiny-gpt2-f16"]:
        shutil.rmtree(ROOT / name, ignore_errors=True)
    model.save_pretrained(ROOT / "hf-tiny-gpt2")
    # About 65 KB of weights in shards of at most 30 KB: three files.
    model.save_pretrained(ROOT / "hf-tiny-gpt2-sharded", max_shard_size="30KB")
    half = GPT2LMHeadModel(config).eval()
    half.load_state_dict(model.state_dict())
    half = half.half()
    half.save_pretrained(ROOT / "hf-tiny-gpt2-f16")
    with torch.no_grad():
        logits_f16 = half.float()(ids).logits

    save_file(
        {"ids": ids.float().contiguous(), "logits": logits.contiguous(), "logits_f16": logits_f16.contiguous()},
        ROOT / "hf-tiny-gpt2-logits.safetensors",
        metadata={"format": "pt", "source": "scripts/make_hf_fixture.py"},
    )
    print("max |logits - logits_f16|:", (logits - logits_f16).abs().max().item())


if __name__ == "__main__":
    main()
