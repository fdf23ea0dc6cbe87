#!/usr/bin/env python3
"""Writes tests/fixtures/llama-kernels.safetensors, what transformers'
Llama computes for the kernels of tests/suite/llama_kernels.rs:

  rope/{base}/{dim}/positions  [P]         position ids (float32, exact)
  rope/{base}/{dim}/cos, sin   [P, dim]    LlamaRotaryEmbedding's, float32
      for (base, dim) = (10000, 64) Llama 2, (100000, 64) SmolLM2,
      (500000, 128) Llama 3; positions 0..15 and 100, 1000, 4000, 8191.
  apply/q, apply/k             [S, T, H, D] inputs: 4 query heads, 2 key
                                            heads (grouped-query), D = 16
  apply/starts                 [S]          each sequence's first position
  apply/q_out, apply/k_out     [S, T, H, D] apply_rotary_pos_emb (base 10000),
      computed in transformers' [S, H, T, D] layout and transposed back
  rmsnorm/x [5, 24], rmsnorm/weight [24], rmsnorm/y [5, 24]
      LlamaRMSNorm with eps 1e-5 (weight noised so it is not all ones)

Run with a Python that has torch, transformers (written with 5.25) and
safetensors:
    python3 scripts/make_llama_kernels_fixture.py
"""

import pathlib

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "llama-kernels.safetensors"


def rotary(base, dim):
    config = LlamaConfig(hidden_size=2 * dim, num_attention_heads=2, head_dim=dim, rope_theta=base)
    return LlamaRotaryEmbedding(config)


def main():
    torch.manual_seed(0)
    tensors = {}
    positions = torch.cat([torch.arange(16), torch.tensor([100, 1000, 4000, 8191])])
    for base, dim in [(10000.0, 64), (100000.0, 64), (500000.0, 128)]:
        x = torch.zeros(1, len(positions), dim)
        cos, sin = rotary(base, dim)(x, positions[None, :])
        key = f"rope/{int(base)}/{dim}"
        tensors[f"{key}/positions"] = positions.float()
        tensors[f"{key}/cos"] = cos[0].contiguous()
        tensors[f"{key}/sin"] = sin[0].contiguous()

    seqs, rows, dim = 2, 7, 16
    starts = torch.tensor([5, 0])
    q = torch.randn(seqs, rows, 4, dim)
    k = torch.randn(seqs, rows, 2, dim)
    position_ids = starts[:, None] + torch.arange(rows)[None, :]
    cos, sin = rotary(10000.0, dim)(q, position_ids)
    q_out, k_out = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    tensors["apply/q"] = q.contiguous()
    tensors["apply/k"] = k.contiguous()
    tensors["apply/starts"] = starts.float()
    tensors["apply/q_out"] = q_out.transpose(1, 2).contiguous()
    tensors["apply/k_out"] = k_out.transpose(1, 2).contiguous()

    norm = LlamaRMSNorm(24, eps=1e-5)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(24))
    x = 2.0 * torch.randn(5, 24)
    with torch.no_grad():
        tensors["rmsnorm/y"] = norm(x)
    tensors["rmsnorm/x"] = x
    tensors["rmsnorm/weight"] = norm.weight.detach().clone()

    save_file({name: t.float().contiguous() for name, t in tensors.items()}, str(OUT))
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
