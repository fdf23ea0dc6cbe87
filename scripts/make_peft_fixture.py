#!/usr/bin/env python3
"""Writes the PEFT LoRA fixture of tests/suite/lora.rs: an adapter folder
that Hugging Face PEFT itself saves, over the committed tiny Llama
(tests/fixtures/hf-tiny-llama, made by scripts/make_llama_fixture.py), and
what PEFT computes with it.

  tests/fixtures/peft-tiny-llama-lora/   adapter_config.json and
      adapter_model.safetensors as `PeftModel.save_pretrained` writes them:
      r 4, lora_alpha 8, lora_dropout 0.05 (inactive in eval mode),
      target_modules q_proj, v_proj, o_proj, up_proj, down_proj (a list,
      so k_proj and gate_proj stay without adapters), bias none.
  tests/fixtures/peft-tiny-llama-lora-reference.safetensors
      ids and targets [2, 16] (token ids stored as float32, exact), the
      logits [2, 16, 37] of the base with the adapter, the mean
      cross-entropy `loss` of the logits against the targets, and
      `grad.<PEFT name>` the gradient of that loss for each adapter matrix.

PEFT's init leaves B zero; here A and B are both drawn at random, so the
adapter changes the logits and both gradients are non-zero.

    pip install peft
    python3 scripts/make_peft_fixture.py
"""

import pathlib
import shutil

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import save_file
from transformers import LlamaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
FOLDER = ROOT / "peft-tiny-llama-lora"


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = LlamaForCausalLM.from_pretrained(ROOT / "hf-tiny-llama", attn_implementation="eager").float().eval()
    config = LoraConfig(
        r=4,
        lora_alpha=8,
        lora_dropout=0.05,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        bias="none",
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    model.eval()
    # A path that means the same on every machine (PEFT writes the one given).
    model.peft_config["default"].base_model_name_or_path = "tests/fixtures/hf-tiny-llama"
    shutil.rmtree(FOLDER, ignore_errors=True)
    model.save_pretrained(FOLDER)
    # The model card PEFT adds is not part of the format.
    (FOLDER / "README.md").unlink(missing_ok=True)

    # Reload as a user would, so the numbers are the saved folder's.
    base = LlamaForCausalLM.from_pretrained(ROOT / "hf-tiny-llama", attn_implementation="eager").float().eval()
    model = PeftModel.from_pretrained(base, FOLDER, is_trainable=True).eval()
    vocab = base.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 16), generator=gen)
    targets = torch.randint(0, vocab, (2, 16), generator=gen)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
    loss.backward()
    out = {
        "ids": ids.float(),
        "targets": targets.float(),
        "logits": logits.detach().contiguous(),
        "loss": loss.detach().reshape(1),
    }
    for name, p in model.named_parameters():
        if "lora_" in name:
            # base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
            # is saved as ....q_proj.lora_A.weight.
            out["grad." + name.replace(".default", "")] = p.grad.detach().contiguous()
    save_file(out, ROOT / "peft-tiny-llama-lora-reference.safetensors")
    print(f"loss {loss.item():.6f}; {sum('grad.' in k for k in out)} adapter gradients")


if __name__ == "__main__":
    main()
