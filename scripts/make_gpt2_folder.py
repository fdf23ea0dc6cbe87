#!/usr/bin/env python3
"""Writes a GPT-2 model folder with random weights, exactly as transformers'
`save_pretrained` writes it (config.json, generation_config.json,
model.safetensors, or shards with model.safetensors.index.json).

The default sizes are GPT-2's 124M (`gpt2`): vocabulary 50257, 1024
positions, 12 layers, 12 heads, 768 channels; weights from transformers'
own init (normal, std `--init-std`, default GPT-2's 0.02).

    /work/venv/bin/python scripts/make_gpt2_folder.py out/gpt2-124m
    /work/venv/bin/python scripts/make_gpt2_folder.py out/gpt2-124m-sharded --max-shard-size 200MB
    # the tests' fixture (tests/fixtures/hf-greedy-gpt2):
    /work/venv/bin/python scripts/make_gpt2_folder.py tests/fixtures/hf-greedy-gpt2 \\
        --vocab-size 96 --n-positions 32 --n-embd 16 --n-layer 2 --n-head 2 --init-std 0.5 --seed 3

Then compare wgrad's greedy ids with transformers' (scripts/check_greedy.py).
"""

import argparse
import pathlib
import shutil

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=pathlib.Path)
    parser.add_argument("--vocab-size", type=int, default=50257)
    parser.add_argument("--n-positions", type=int, default=1024)
    parser.add_argument("--n-embd", type=int, default=768)
    parser.add_argument("--n-layer", type=int, default=12)
    parser.add_argument("--n-head", type=int, default=12)
    parser.add_argument("--init-std", type=float, default=0.02, help="GPT2Config.initializer_range")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-size", default=None, help="e.g. 200MB: shards with an index, as save_pretrained writes them")
    args = parser.parse_args()

    torch.manual_seed(args.seed)
    config = GPT2Config(
        vocab_size=args.vocab_size,
        n_positions=args.n_positions,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=args.n_head,
        initializer_range=args.init_std,
        # The end-of-text token is the vocabulary's last, as GPT-2's 50256.
        bos_token_id=args.vocab_size - 1,
        eos_token_id=args.vocab_size - 1,
    )
    model = GPT2LMHeadModel(config).eval()
    shutil.rmtree(args.dir, ignore_errors=True)
    if args.max_shard_size:
        model.save_pretrained(args.dir, max_shard_size=args.max_shard_size)
    else:
        model.save_pretrained(args.dir)
    params = sum(p.numel() for p in model.parameters())
    files = sorted(p.name for p in args.dir.iterdir())
    print(f"{args.dir}: {params} parameters, files {files}")


if __name__ == "__main__":
    main()
