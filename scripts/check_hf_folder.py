#!/usr/bin/env python3
"""Opens a wgrad model folder with Hugging Face transformers and compares
its logits with the ones wgrad computed (examples/hf_folder.rs writes both;
config.json's architecture picks the class: GPT2LMHeadModel or
LlamaForCausalLM).

    cargo run --release --example hf_folder -- gpt out/gpt-folder   # or: llama out/llama-folder
    /work/venv/bin/python scripts/check_hf_folder.py out/gpt-folder [LOGITS] [--atol 1e-4]

The other direction (folders `save_pretrained` wrote, loaded by wgrad) is
tests/suite/gpt_folder.rs and tests/suite/llama_folder.rs over
scripts/make_hf_fixture.py's and scripts/make_llama_fixture.py's fixtures.

LOGITS defaults to DIR.logits.safetensors (tensors `ids` [N, T] as float32
and `logits` [N, T, V]). Exits 1 when any logit differs by more than atol.

A folder with its own tokenizer (`wgrad train --init` saves one) is
checked the same way after examples/folder_logits.rs, which also stores
the text it encoded: AutoTokenizer must give wgrad's ids for it.

    cargo run --release --example folder_logits -- out/tuned
    /work/venv-ref/bin/python scripts/check_hf_folder.py out/tuned --atol 1e-3
"""

import argparse
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("logits", nargs="?")
    parser.add_argument("--atol", type=float, default=1e-4)
    args = parser.parse_args()

    # output_loading_info lists missing or unexpected weights: a folder that
    # needed any of them initialised at random would not be wgrad's model.
    model, info = AutoModelForCausalLM.from_pretrained(args.dir, output_loading_info=True)
    problems = {k: v for k, v in info.items() if v}
    if problems:
        print(f"loading reported {problems}")
        return 1
    model.eval()
    logits_path = args.logits or args.dir.rstrip("/") + ".logits.safetensors"
    wgrad = load_file(logits_path)
    ids = wgrad["ids"].long()
    with safe_open(logits_path, "pt") as f:
        text = (f.metadata() or {}).get("text")
    if text is not None:
        from transformers import AutoTokenizer

        hf_ids = AutoTokenizer.from_pretrained(args.dir)(text)["input_ids"]
        if hf_ids != ids[0].tolist():
            print(f"the folder's tokenizer gives {hf_ids}, wgrad gave {ids[0].tolist()}")
            return 1
        print(f"{args.dir}: AutoTokenizer gives wgrad's {len(hf_ids)} ids for the text")
    with torch.no_grad():
        logits = model(ids).logits
    diff = (logits - wgrad["logits"]).abs().max().item()
    print(f"{args.dir}: {type(model).__name__}, {tuple(logits.shape)} logits, max |transformers - wgrad| = {diff:.3g} (atol {args.atol:g})")
    return 0 if diff <= args.atol else 1


if __name__ == "__main__":
    sys.exit(main())
