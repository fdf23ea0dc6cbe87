#!/usr/bin/env python3
"""Writes tests/fixtures/perplexity-reference.json: transformers' mean
next-token loss on the windows `wgrad perplexity` scores, for
cli/tests/cli_perplexity.rs to compare with. Each case is a GGUF file
transformers de-quantizes to float32 (`gguf_file=`), a text, a window
length and a token budget; the windows are llama.cpp's llama-perplexity's,
as wgrad::infer::perplexity documents them:

  - the text is tokenized whole, with the tokenizer's special tokens (a
    BOS first where the tokenizer adds one), then cut to --max-tokens;
  - non-overlapping windows of `context` tokens; the tokens after the last
    whole window are left out;
  - where the tokenizer adds a BOS, each window's first token is replaced
    by it;
  - each window runs from position 0 and scores only its second half:
    the logits at positions context//2 .. context-2 against the tokens
    after them (context - 1 - context//2 predictions per window);
  - the mean loss is over every scored prediction (nats), the perplexity
    its exponential.

Any family transformers reads from GGUF works: a case is one more entry in
CASES (the model's file name in wgrad's cache, or its variable). The model
files are never committed:
    python3 scripts/perplexity_reference.py            # every case whose file is present
    python3 scripts/perplexity_reference.py smollm2    # only the cases named
    python3 scripts/perplexity_reference.py --print    # compute, print, write nothing
"""

import gzip
import json
import math
import os
import pathlib
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "perplexity-reference.json"
CACHE = pathlib.Path.home() / ".cache" / "wgrad" / "models"
# (case name, the variable naming the file, the file in wgrad's cache,
# the text under the repository root, context, max tokens).
CASES = [
    ("smollm2", "WGRAD_SMOLLM2", "SmolLM2-135M-Instruct.Q4_1.gguf", "data/shakespeare.txt.gz", 128, 512),
    ("gemma3", "WGRAD_GEMMA3", "gemma-3-270m-q4_k_m.gguf", "data/shakespeare.txt.gz", 128, 512),
]


def read_text(path):
    data = path.read_bytes()
    if path.suffix == ".gz":
        data = gzip.decompress(data)
    return data.decode("utf-8")


def leading_bos(tokenizer):
    """The BOS the tokenizer puts first, or None (as wgrad's leading_bos)."""
    ids = tokenizer("", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id
    return bos if bos is not None and ids[:1] == [bos] else None


def score(model, tokens, context, bos):
    first = context // 2
    windows = len(tokens) // context
    losses = []
    with torch.no_grad():
        for w in range(windows):
            window = list(tokens[w * context:(w + 1) * context])
            if bos is not None:
                window[0] = bos
            logits = model(torch.tensor([window])).logits[0].double()
            scored = logits[first:context - 1]
            targets = torch.tensor(window[first + 1:])
            losses.append(torch.nn.functional.cross_entropy(scored, targets, reduction="sum").item())
    scored = windows * (context - 1 - first)
    return windows, scored, sum(losses) / scored


def main():
    write = "--print" not in sys.argv
    names = [a for a in sys.argv[1:] if not a.startswith("--")]
    results = json.loads(OUT.read_text()) if OUT.exists() else {"cases": []}
    by_name = {c["name"]: c for c in results["cases"]}
    for name, variable, file, text_path, context, max_tokens in CASES:
        if names and name not in names:
            continue
        path = pathlib.Path(os.environ.get(variable, CACHE / file))
        if not path.is_file():
            print(f"{name}: {path} is missing, skipped (kept as it was)")
            continue
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.eval()
        tokens = tokenizer(read_text(ROOT / text_path), add_special_tokens=True)["input_ids"]
        total = len(tokens)
        tokens = tokens[:max_tokens]
        bos = leading_bos(tokenizer)
        windows, scored, mean_loss = score(model, tokens, context, bos)
        print(f"{name}: {total} tokens, {windows} windows of {context}, {scored} scored, BOS {bos}: "
              f"mean loss {mean_loss:.6f} nats, perplexity {math.exp(mean_loss):.4f}")
        by_name[name] = {
            "name": name,
            "model": file,
            "text": text_path,
            "context": context,
            "max_tokens": max_tokens,
            "text_tokens": total,
            "bos": bos,
            "windows": windows,
            "scored": scored,
            "mean_loss": mean_loss,
            "perplexity": math.exp(mean_loss),
        }
        # After each case: a later case's model may take long to load.
        if write:
            cases = [by_name[c[0]] for c in CASES if c[0] in by_name]
            OUT.write_text(json.dumps({"cases": cases}, indent=1) + "\n")
            print(f"{OUT}: {OUT.stat().st_size} bytes")


if __name__ == "__main__":
    main()
