#!/usr/bin/env python3
"""Loads a LoRA adapter folder wgrad wrote (`wgrad train --lora`, or
`wgrad::io::peft::save_lora`) with Hugging Face PEFT over its base model and
compares the logits with the ones wgrad computed.

    cargo run --release --example folder_logits -- BASE [TEXT] --lora ADAPTER
    python3 scripts/check_peft_adapter.py BASE ADAPTER [LOGITS] [--atol 1e-4]

BASE is a Hugging Face folder, or a GGUF file, which transformers loads
de-quantized to f32 (as wgrad trained over it: a Q4_1 base is its Q4_1
values). `PeftModel.from_pretrained(base, ADAPTER)` then loads the adapter:
every tensor of adapter_model.safetensors must land in a LoRA matrix of the
model, with its values (PEFT only warns about names that fit nothing).

LOGITS defaults to ADAPTER.logits.safetensors (tensors `ids` [N, T] as
float32 and `logits` [N, T, V], as examples/folder_logits.rs writes them).
Prints the largest difference beside the adapter's own effect on the
logits (the base's logits against the adapted ones), and exits 1 when the
difference exceeds atol. tests/suite/lora_export.rs runs it where torch,
transformers, peft and gguf import.

`--merged DIR` also loads the Hugging Face folder `wgrad export` merged
the adapter into (with transformers alone) and checks that its logits are
PEFT's on the same ids (--ids when there is no LOGITS file):

    wgrad export --model BASE --lora ADAPTER --out merged
    python3 scripts/check_peft_adapter.py BASE ADAPTER --merged merged --ids 1,2,3,4
"""

import argparse
import json
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def load_base(path):
    if path.endswith(".gguf"):
        folder, name = os.path.split(os.path.abspath(path))
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("base")
    parser.add_argument("adapter")
    parser.add_argument("logits", nargs="?")
    parser.add_argument("--atol", type=float, default=1e-4)
    parser.add_argument("--merged", help="a merged Hugging Face folder to compare with PEFT's logits")
    parser.add_argument("--ids", help="comma-separated token ids, without a LOGITS file")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from peft import PeftModel

    base = load_base(args.base).eval()
    model = PeftModel.from_pretrained(base, args.adapter).eval()
    config = json.load(open(os.path.join(args.adapter, "adapter_config.json")))

    # Every saved matrix is in the model, with its values.
    saved = load_file(os.path.join(args.adapter, "adapter_model.safetensors"))
    params = dict(model.named_parameters())
    for name, value in saved.items():
        # PEFT names the loaded copy after its adapter (`default`).
        loaded = params.get(name.replace(".lora_A.weight", ".lora_A.default.weight")
                            .replace(".lora_B.weight", ".lora_B.default.weight"))
        if loaded is None:
            print(f"`{name}` fits no LoRA matrix of {type(base).__name__}")
            return 1
        if loaded.shape != value.shape or not torch.equal(loaded.detach().float(), value.float()):
            print(f"`{name}` loaded as {tuple(loaded.shape)} with other values than the file's {tuple(value.shape)}")
            return 1
    print(f"{args.adapter}: PEFT loaded all {len(saved)} matrices (r={config['r']}, "
          f"lora_alpha={config['lora_alpha']}, targets {config['target_modules']}) over {type(base).__name__}")

    logits_path = args.logits or args.adapter.rstrip("/") + ".logits.safetensors"
    wgrad = None
    if args.ids is not None:
        ids = torch.tensor([[int(t) for t in args.ids.split(",") if t.strip()]])
    else:
        wgrad = load_file(logits_path)
        ids = wgrad["ids"].long()
        with safe_open(logits_path, "pt") as f:
            text = (f.metadata() or {}).get("text")
        if text is not None and os.path.isdir(args.base):
            from transformers import AutoTokenizer

            hf_ids = AutoTokenizer.from_pretrained(args.base)(text)["input_ids"]
            if hf_ids != ids[0].tolist():
                print(f"the base's tokenizer gives {hf_ids}, wgrad gave {ids[0].tolist()}")
                return 1
    with torch.no_grad():
        logits = model(input_ids=ids).logits
        with model.disable_adapter():
            plain = model(input_ids=ids).logits
    effect = (logits - plain).abs().max().item()
    failed = False
    if wgrad is not None:
        diff = (logits - wgrad["logits"]).abs().max().item()
        print(f"{tuple(logits.shape)} logits: max |PEFT - wgrad| = {diff:.3g} (atol {args.atol:g}); "
              f"the adapter moves them by up to {effect:.3g}")
        failed |= diff > args.atol
    if args.merged:
        merged, info = AutoModelForCausalLM.from_pretrained(args.merged, dtype=torch.float32, output_loading_info=True)
        problems = {k: v for k, v in info.items() if v}
        if problems:
            print(f"loading {args.merged} reported {problems}")
            return 1
        with torch.no_grad():
            merged_logits = merged.eval()(input_ids=ids).logits
        diff = (merged_logits - logits).abs().max().item()
        print(f"{args.merged}: {type(merged).__name__}, max |merged - PEFT| = {diff:.3g} (atol {args.atol:g}); "
              f"the adapter moves the logits by up to {effect:.3g}")
        failed |= diff > args.atol
    if effect <= 10 * args.atol:
        print("note: the adapter barely changes the logits (B near zero?), so this check says little")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
