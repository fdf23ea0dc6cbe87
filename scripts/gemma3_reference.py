#!/usr/bin/env python3
"""Writes tests/fixtures/gemma3-reference.json: what transformers computes
on Gemma 3 270M's Q4_K_M GGUF file (`gemma-3-270m-q4_k_m.gguf`, fetched by
scripts/fetch-gemma3.sh) after de-quantizing it to float32 (`gguf_file=`),
for tests/suite/gemma_gguf.rs and `wgrad generate` to compare with, as
scripts/smollm2_reference.py does for SmolLM2. For each fixed prompt:

  text        the prompt;
  ids         its token ids from the file's own tokenizer as transformers
              builds it (BOS first: the file says add_bos_token);
  greedy      the first 24 greedy tokens (the argmax at each step);
  margins     each greedy step's gap between the top two logits;
  top_ids, top_logits
              the 64 largest logits at the prompt's last position.

The model file is never committed; pass its path (default: the
WGRAD_GEMMA3 variable, else ~/.cache/wgrad/models/…):
    python3 scripts/gemma3_reference.py [FILE.gguf]
"""

import json
import os
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "gemma3-reference.json"
DEFAULT = pathlib.Path.home() / ".cache" / "wgrad" / "models" / "gemma-3-270m-q4_k_m.gguf"
PROMPTS = [
    "def fibonacci(n):",
    "The history of the Roman Empire",
]
NEW_TOKENS = 24
TOP = 64


def main():
    torch.set_num_threads(1)
    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("WGRAD_GEMMA3", DEFAULT))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    print(type(model).__name__, model.config.query_pre_attn_scalar, model.config.layer_types[:6],
          model.config.rope_parameters, model.config.sliding_window)
    cases = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        sequence, greedy, margins = list(ids), [], []
        with torch.no_grad():
            for _ in range(NEW_TOKENS):
                logits = model(torch.tensor([sequence])).logits[0, -1].float()
                if not greedy:
                    last = logits
                top2 = torch.topk(logits, 2)
                greedy.append(int(top2.indices[0]))
                margins.append(float(top2.values[0] - top2.values[1]))
                sequence.append(greedy[-1])
        top = torch.topk(last, TOP)
        cases.append({
            "text": text,
            "ids": ids,
            "greedy": greedy,
            "greedy_text": tokenizer.decode(greedy),
            "margins": margins,
            "top_ids": top.indices.tolist(),
            "top_logits": top.values.tolist(),
        })
        print(f"{text!r}: ids {ids} -> {tokenizer.decode(greedy)!r}, margins {[round(m, 3) for m in margins]}")
    OUT.write_text(json.dumps({"model": path.name, "new_tokens": NEW_TOKENS, "prompts": cases}, ensure_ascii=False) + "\n")
    print(f"{OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
