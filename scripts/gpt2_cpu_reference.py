#!/usr/bin/env python3
"""transformers on PyTorch CPU for `wgrad bench`'s GPT-2 124M lines: the
same shape (random weights), the same prompt and decode lengths, on
`--threads` cores (2 by default, as LP_NUM_THREADS=2 gives lavapipe).
Prints lines in `wgrad bench`'s format:

    bench torch_gpt2_124m_prefill tokens_per_s=…
    bench torch_gpt2_124m_decode dtype=f32 tokens_per_s=… bytes_per_token=… copy_gbps=… bandwidth_share=…

Prefill is one forward over the prompt (use_cache, as `generate` starts);
decode is greedy, one token per forward with the KV cache, timed over
`--new-tokens` steps after a warm-up. bytes_per_token counts what wgrad's
does (every parameter once, one position row, the KV cache so far), and
copy_gbps is a `torch` copy of 64 MiB (bytes read plus written per second).

    /work/venv/bin/python scripts/gpt2_cpu_reference.py --prompt-tokens 16 --new-tokens 8
"""

import argparse
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def copy_gbps(reps=5):
    src = torch.ones(16 << 20)
    dst = torch.empty_like(src)
    times = []
    for _ in range(reps + 1):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    times = sorted(times[1:])
    return 2 * src.numel() * 4 / times[len(times) // 2] / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = GPT2Config()
    model = GPT2LMHeadModel(config).eval()
    prompt = torch.randint(0, config.vocab_size, (1, args.prompt_tokens))

    def prefill():
        return model(prompt, use_cache=True)

    def decode(out):
        past, logits = out.past_key_values, out.logits[:, -1]
        for _ in range(args.new_tokens):
            token = logits.argmax(-1, keepdim=True)
            out = model(token, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]

    with torch.no_grad():
        decode(prefill())  # warm-up
        start = time.perf_counter()
        out = prefill()
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        decode(out)
        decode_s = time.perf_counter() - start

    c, layers = config.n_embd, config.n_layer
    params = sum(p.numel() for p in model.parameters()) - config.n_positions * c + c
    positions = range(args.prompt_tokens, args.prompt_tokens + args.new_tokens)
    bytes_per_token = sum((params + 2 * layers * (p + 1) * c) * 4 for p in positions) // args.new_tokens
    tokens_per_s = args.new_tokens / decode_s
    copy = copy_gbps()
    print(f"bench torch_gpt2_124m_prefill tokens_per_s={args.prompt_tokens / prefill_s:.1f} prompt_tokens={args.prompt_tokens} threads={args.threads}")
    print(
        f"bench torch_gpt2_124m_decode dtype=f32 tokens_per_s={tokens_per_s:.2f} bytes_per_token={bytes_per_token} "
        f"copy_gbps={copy:.2f} bandwidth_share={bytes_per_token * tokens_per_s / (copy * 1e9):.4f} new_tokens={args.new_tokens} threads={args.threads}"
    )


if __name__ == "__main__":
    main()
