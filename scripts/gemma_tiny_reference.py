#!/usr/bin/env python3
"""PyTorch reference for wgrad's Gemma 3 (src/models/gemma.rs), as
scripts/qwen_reference.py is for Qwen: one fixed batch, the logits, the
loss, every gradient, then 10 clipped AdamW steps and the parameters they
end at.

The model is transformers' own Gemma3ForCausalLM (text-only
Gemma3TextConfig, random init, eager attention): 3 layers whose middle one
is global (sliding_window_pattern 2: local, global, local; local rotary
base 10,000, global 1,000,000), 4 heads of 24 channels over 2 KV heads on
64 channels (head_dim is not hidden / heads), query_pre_attn_scalar 20
(not head_dim, so the score scale is checked), an intermediate width (172)
and a vocabulary (73) that no tile divides, tied head. The sliding window
is the whole 16-position context. transformers initialises Gemma's norm
weights to zero (the norm scales by 1 + weight), which would hide a weight
read in the wrong place, so every one-dimensional parameter gets noise.
No pad token: transformers' embedding would zero its row's gradient.

Writes tests/fixtures/gemma3_reference.safetensors, which
tests/suite/gemma_reference.rs compares wgrad with:

    python3 scripts/gemma_tiny_reference.py
"""

import math
import os

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

from reference_training import loss_of, max_diff, optimizer_meta, print_steps, step_tensors, train, write_fixture

BLOCK, N_LAYER, N_HEAD, N_KV_HEAD, N_EMBD, HEAD_DIM, INTERMEDIATE, VOCAB = 16, 3, 4, 2, 64, 24, 172, 73
GLOBAL_THETA, LOCAL_THETA, EPS_NORM, QUERY_SCALAR, PATTERN = 1e6, 1e4, 1e-6, 20, 2
BATCH = 3
SEED = 4
CLIP = 1.5

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")


def config():
    return Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=N_EMBD, intermediate_size=INTERMEDIATE, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=N_KV_HEAD, head_dim=HEAD_DIM, max_position_embeddings=BLOCK,
        rms_norm_eps=EPS_NORM, query_pre_attn_scalar=QUERY_SCALAR, sliding_window=BLOCK,
        layer_types=["full_attention" if (i + 1) % PATTERN == 0 else "sliding_attention" for i in range(N_LAYER)],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": GLOBAL_THETA},
            "sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
        },
        hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True, initializer_range=0.02,
        pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def build():
    model = Gemma3ForCausalLM._from_config(config(), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def forward(model, idx):
    return model(input_ids=idx, use_cache=False).logits


def decayed(name, p):
    return p.dim() >= 2 and "embed_tokens" not in name


def fresh(init, dtype):
    m = build().to(dtype)
    m.load_state_dict({n: v.to(dtype) for n, v in init.items()}, strict=False)
    return m


def main():
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(SEED + 1)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=gen)
    targets = idx.roll(1, dims=1)

    torch.manual_seed(SEED)
    model = build()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = forward(model, idx)
    loss = loss_of(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    model = fresh(init, torch.float32)
    losses, norms = train(model, forward, idx, targets, groups=decayed, clip=CLIP)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}

    m64 = fresh(init, torch.float64)
    logits64 = forward(m64, idx)
    loss64 = loss_of(logits64, targets)
    loss64.backward()
    grad_noise = max(max_diff(grads[n], p.grad) for n, p in m64.named_parameters())
    m64 = fresh(init, torch.float64)
    losses64, norms64 = train(m64, forward, idx, targets, groups=decayed, clip=CLIP)
    final64 = dict(m64.named_parameters())

    print(f"gemma3: vocab {VOCAB}, positions {BLOCK}, layers {N_LAYER}, heads {N_HEAD} of {HEAD_DIM} over "
          f"{N_KV_HEAD} KV heads, embd {N_EMBD}, intermediate {INTERMEDIATE}; batch {BATCH}")
    print(f"parameters: {sum(p.numel() for p in init.values())}")
    print(f"initial loss {loss.item():.7f} (ln V = {math.log(VOCAB):.7f})")
    print("float32 against float64 (the noise floor):")
    print(f"  logits {max_diff(logits, logits64):.2e}, loss {abs(loss.item() - loss64.item()):.2e}, gradients {grad_noise:.2e}")
    print(f"  step losses {max(abs(a - b) for a, b in zip(losses, losses64)):.2e}, "
          f"grad norms {max(abs(a - b) for a, b in zip(norms, norms64)):.2e}, "
          f"final parameters {max(max_diff(final[n], final64[n]) for n in final):.2e}")
    clipped = print_steps(losses, norms, CLIP)

    tensors = {
        "idx": idx.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach(),
        "loss": loss.detach().reshape(1),
        **step_tensors(losses, norms),
    }
    meta = {
        "vocab_size": VOCAB, "block_size": BLOCK, "n_layer": N_LAYER, "n_head": N_HEAD, "n_kv_head": N_KV_HEAD,
        "head_dim": HEAD_DIM, "n_embd": N_EMBD, "intermediate_size": INTERMEDIATE, "rope_theta": GLOBAL_THETA,
        "rope_local_theta": LOCAL_THETA, "rms_norm_eps": EPS_NORM, "query_pre_attn_scalar": QUERY_SCALAR,
        "sliding_window": BLOCK, "sliding_window_pattern": PATTERN, **optimizer_meta(CLIP),
    }
    named = {"init": init, "grad": grads, "final": final}
    write_fixture(os.path.join(FIXTURES, "gemma3_reference.safetensors"), tensors, named, meta, clipped)


if __name__ == "__main__":
    main()
