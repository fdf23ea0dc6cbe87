"""The PyTorch + PEFT reference for wgrad's QLoRA run on SmolLM2 (issue 38's
done-when):

    wgrad train --init SmolLM2-135M-Instruct.Q4_1.gguf \\
        --lora r=16,alpha=32,targets=all-linear --text data/shakespeare.txt.gz \\
        --block-size 128 --batch-size 4 --max-steps 50 --lr LR

with the same data protocol: the file's model de-quantized (transformers
reads the GGUF file), the text tokenized by SmolLM2's tokenizer (no special
tokens; the tokenizer transformers builds from the file), the last 10% held out (the cut at round(0.9·len)), random windows
of 129 tokens from the first 90% (drawn by torch's generator: not wgrad's
ChaCha8, so the batches differ), and the held-out loss as the mean over the
same fixed windows wgrad scores (`train::validation_windows`: eval_batches ×
batch windows evenly spaced from the held-out text's start, one forward per
batch of them). The optimizer is wgrad's `--init` default: AdamW, betas
(0.9, 0.99), eps 1e-8, weight decay 0.1 on matrices (the adapters' A and B),
a constant learning rate, no warmup, gradients clipped to norm 1. LoRA as
PEFT initialises it (A kaiming-uniform, B zero), r 16, alpha 32, no
dropout, on every Linear but the head.

    python scripts/peft_reference_run.py [--gguf PATH] [--lr 1e-3]

Prints the held-out loss at step 0 and every --eval-every steps, and the
fall from step 0 to the last step.
"""

import argparse
import gzip
import math
import os
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--gguf",
        default=os.path.expanduser("~/.cache/wgrad/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    p.add_argument("--text", default=os.path.join(ROOT, "data", "shakespeare.txt.gz"))
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--threads", type=int, default=0)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging

    logging.disable_progress_bar()

    torch.manual_seed(args.seed)
    where, name = os.path.dirname(args.gguf), os.path.basename(args.gguf)
    model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
    config = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", bias="none")
    model = get_peft_model(model, config)
    model.print_trainable_parameters()

    opener = gzip.open if args.text.endswith(".gz") else open
    with opener(args.text, "rt", encoding="utf-8") as f:
        text = f.read()
    tokens = tokenizer(text, add_special_tokens=False)["input_ids"]
    tokens = torch.tensor(tokens, dtype=torch.long)
    cut = round(len(tokens) * 0.9)
    train, held_out = tokens[:cut], tokens[cut:]
    t = args.block_size
    print(f"{len(tokens)} tokens: {len(train)} train, {len(held_out)} held out")

    # train::validation_windows: count windows of t + 1, window i at i·stride.
    count = args.eval_batches * args.batch_size
    stride = (len(held_out) - (t + 1)) // count
    windows = torch.stack([held_out[i * stride : i * stride + t + 1] for i in range(count)])

    @torch.no_grad()
    def held_out_loss():
        model.eval()
        total = 0.0
        for b in range(args.eval_batches):
            w = windows[b * args.batch_size : (b + 1) * args.batch_size]
            logits = model(w[:, :-1]).logits
            total += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1)).item()
        model.train()
        return total / args.eval_batches

    trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    decay = [q for _, q in trainable if q.dim() >= 2]
    no_decay = [q for _, q in trainable if q.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.99),
        eps=1e-8,
    )
    generator = torch.Generator().manual_seed(args.seed)
    start = held_out_loss()
    print(f"held-out loss at step 0: {start:.4f}")
    began = time.time()
    last = start
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(train) - t - 1, (args.batch_size,), generator=generator)
        batch = torch.stack([train[s : s + t + 1] for s in starts])
        logits = model(batch[:, :-1]).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for _, q in trainable], 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            last = held_out_loss()
            print(f"step {step}: train loss {loss.item():.4f}, held-out loss {last:.4f} ({time.time() - began:.0f} s)")
    print(
        f"held-out loss: step 0 {start:.4f}, step {args.steps} {last:.4f} ({last - start:+.4f} nats) "
        f"at lr {args.lr:g}"
    )
    assert math.isfinite(last)


if __name__ == "__main__":
    main()
