#!/usr/bin/env python3
"""Greedy generation of a GPT-2 model folder with transformers, compared
with wgrad's.

    cargo build --release
    /work/venv/bin/python scripts/check_greedy.py out/gpt2-124m \\
        --prompt-ids 464,2068,7586,21831 --max-new-tokens 20 --wgrad target/release/wgrad

runs `wgrad generate --model DIR --prompt-ids … --temperature 0
--max-new-tokens N --print-ids`, then transformers' `generate` (greedy,
do_sample=False, no stop at the end-of-text token) on the same prompt ids,
and prints both id lists, the first position where they differ, and the
smallest gap between the best and second-best logit along transformers'
path (where the two could pick differently within float rounding). Exits 1
when the ids differ. Without --wgrad it prints transformers' ids only;
--write FILE saves {prompt, greedy, min_gap} as JSON (the tests' fixture,
tests/fixtures/hf-greedy-gpt2-ids.json).
"""

import argparse
import json
import subprocess
import sys

import torch
from transformers import GPT2LMHeadModel


def transformers_greedy(model_dir, prompt, new_tokens):
    model = GPT2LMHeadModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=0,
            do_sample=False,
            num_beams=1,
            eos_token_id=None,
            pad_token_id=model.config.eos_token_id,
            return_dict_in_generate=True,
            output_logits=True,
        )
    greedy = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for logits in out.logits:
        top = torch.topk(logits[0].float(), 2).values
        gaps.append((top[0] - top[1]).item())
    return greedy, gaps


def wgrad_greedy(wgrad, model_dir, prompt, new_tokens):
    cmd = [
        wgrad, "generate", "--model", model_dir,
        "--prompt-ids", ",".join(map(str, prompt)),
        "--temperature", "0", "--max-new-tokens", str(new_tokens), "--print-ids",
    ]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr}")
    print(run.stderr.strip())
    for line in run.stdout.splitlines():
        if line.startswith("new_ids"):
            return [int(t) for t in line.split()[1:]]
    sys.exit(f"no new_ids line in wgrad's output:\n{run.stdout}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir")
    parser.add_argument("--prompt-ids", required=True, help="comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=20)
    parser.add_argument("--wgrad", help="the wgrad binary to compare with")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--write", help="save prompt, greedy ids and the smallest logit gap as JSON")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]

    greedy, gaps = transformers_greedy(args.dir, prompt, args.max_new_tokens)
    min_gap = min(gaps)
    print(f"transformers: {' '.join(map(str, greedy))}")
    print(f"smallest top-1/top-2 logit gap: {min_gap:.3g} (at new token {gaps.index(min_gap)})")
    if args.write:
        with open(args.write, "w") as f:
            json.dump({"prompt": prompt, "greedy": greedy, "min_gap": min_gap, "source": "scripts/check_greedy.py"}, f, indent=1)
            f.write("\n")
    if not args.wgrad:
        return 0
    ours = wgrad_greedy(args.wgrad, args.dir, prompt, args.max_new_tokens)
    print(f"wgrad:        {' '.join(map(str, ours))}")
    if ours == greedy:
        print(f"equal: all {len(greedy)} new token ids")
        return 0
    first = next((i for i, (a, b) in enumerate(zip(ours, greedy)) if a != b), min(len(ours), len(greedy)))
    print(f"DIFFER from new token {first}: wgrad {ours[first:first + 1]}, transformers {greedy[first:first + 1]}, logit gap there {gaps[first] if first < len(gaps) else float('nan'):.3g}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
