#!/usr/bin/env python3
"""PyTorch's side of the README's comparison with wgrad's GPT training on
the shipped Shakespeare: the same model, optimizer and data protocol as
wgrad's trainer, so the validation losses of the two can be set side by
side. The batches come from torch's RNG, not wgrad's, so the comparison is
statistical, not bit for bit (scripts/gpt_reference.py is the exact one).

    /work/venv/bin/python scripts/train_reference.py [--max-steps 240 ...]

Data protocol (as wgrad::text):
- the text is data/shakespeare.txt.gz; the vocabulary is its distinct
  characters sorted by code point (CharTokenizer::from_text);
- the last 10% of the tokens are held out (held_out_split(tokens, 0.1):
  cut = round(len · 0.9), rounding half away from zero);
- training batches are random windows of block_size + 1 tokens of the
  training part (random_windows: start uniform in [0, len - block_size));
- the validation loss is the mean cross-entropy over eval_batches ×
  batch_size fixed windows of the validation part, window i starting at
  i · stride with stride = (len(val) - block_size - 1) // (eval_batches ·
  batch_size), every eval_every steps and after the last step.
Optimizer: AdamW with weight decay on the Linear weights only (wgrad's
decay_matrices_only), clip_grad_norm_, warmup-cosine to min_lr at max_steps.
"""

import argparse
import gzip
import math
import os
import time

import torch

from gpt_reference import Gpt, GptConfig, decayed, loss_of, lr_at

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "shakespeare.txt.gz")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=240)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-4)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.99)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eval-every", type=int, default=40)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def held_out_split(tokens, fraction):
    """wgrad::text::held_out_split: Rust's f64::round rounds half away from
    zero, Python's round() to even, so round by hand."""
    x = len(tokens) * (1.0 - fraction)
    cut = math.floor(x)
    if x - cut >= 0.5:
        cut += 1
    if cut == 0 or cut == len(tokens):
        raise ValueError(f"{len(tokens)} tokens leave one side empty")
    return tokens[:cut], tokens[cut:]


def windows(tokens, starts, block_size):
    """Inputs [len(starts), block_size] and the same windows one token on."""
    rows = torch.stack([tokens[s:s + block_size + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def validation_loss(model, val, args):
    count = args.eval_batches * args.batch_size
    stride = (len(val) - args.block_size - 1) // count
    if stride < 1:
        raise ValueError(f"{len(val)} validation tokens cannot give {count} windows of {args.block_size + 1}")
    model.eval()
    total = 0.0
    for b in range(args.eval_batches):
        starts = torch.arange(b * args.batch_size, (b + 1) * args.batch_size) * stride
        x, y = windows(val, starts, args.block_size)
        total += loss_of(model(x), y).item()
    model.train()
    # Every batch has the same number of tokens: the mean of the batch means
    # is the mean over all of them.
    return total / args.eval_batches


def main():
    args = parse_args()
    torch.set_num_threads(2)
    with gzip.open(TEXT, "rb") as f:
        text = f.read().decode("utf-8")
    chars = sorted(set(text))
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([index[c] for c in text], dtype=torch.long)
    train, val = held_out_split(tokens, 0.1)
    print(f"text: {len(text)} characters, vocabulary {len(chars)}; train {len(train)} tokens, validation {len(val)}")

    torch.manual_seed(args.seed)
    cfg = GptConfig(len(chars), args.block_size, args.n_layer, args.n_head, args.n_embd)
    model = Gpt(cfg)
    named = list(model.named_parameters())
    print(f"model: {cfg}, {sum(p.numel() for _, p in named)} parameters")
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if decayed(n, p)], "weight_decay": args.weight_decay},
            {"params": [p for n, p in named if not decayed(n, p)], "weight_decay": 0.0},
        ],
        lr=args.lr, betas=(args.beta1, args.beta2), eps=1e-8,
    )
    batches = torch.Generator().manual_seed(args.seed)

    train_seconds, last_eval = 0.0, None
    for step in range(1, args.max_steps + 1):
        started = time.perf_counter()
        starts = torch.randint(0, len(train) - args.block_size, (args.batch_size,), generator=batches)
        x, y = windows(train, starts, args.block_size)
        opt.zero_grad(set_to_none=True)
        loss = loss_of(model(x), y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.lr, args.min_lr, args.warmup, args.max_steps)
        opt.step()
        train_loss = loss.item()
        train_seconds += time.perf_counter() - started
        if step % 10 == 0 or step == 1:
            print(f"step {step} loss {train_loss:.4f} grad_norm {norm.item():.3f} lr {opt.param_groups[0]['lr']:.2e}", flush=True)
        if step % args.eval_every == 0 or step == args.max_steps:
            last_eval = validation_loss(model, val, args)
            print(f"val_loss step={step} loss={last_eval:.4f}", flush=True)

    ms_per_step = 1000.0 * train_seconds / args.max_steps
    tokens_per_s = args.max_steps * args.batch_size * args.block_size / train_seconds
    print(f"{ms_per_step:.1f} ms/step, {tokens_per_s:.0f} tokens/s (training steps only, {torch.get_num_threads()} threads)")
    print(f"final val_loss {last_eval:.4f}")


if __name__ == "__main__":
    main()
