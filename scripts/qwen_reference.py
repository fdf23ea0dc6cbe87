#!/usr/bin/env python3
"""PyTorch reference for wgrad's Qwen2, Qwen3 and Mistral, as scripts/llama_reference.py
is for the Llama: one fixed batch, the logits, the loss, every gradient,
then 10 clipped AdamW steps and the parameters they end at; and a
tied-head variant's logits, loss and gradients.

The models are transformers' own Qwen2ForCausalLM, Qwen3ForCausalLM and
MistralForCausalLM (random init, eager attention), so the names are Hugging
Face's. Qwen2 has biases on q, k and v; Qwen3 has an RMSNorm over each q
and k head and a head width (24) that is not hidden / heads (64 / 4).
Mistral's attention slides over a window of 5 positions, shorter than the
16 of the batch, so every query from the sixth on sees a part of its causal
context only: a model that ignored the window would miss these logits by
far more than the tolerance (checked below). transformers
initialises biases to zero and norms to one, which would hide a bias or a
norm weight read in the wrong place, so every one-dimensional parameter
(biases, norm weights) gets noise on top of the init.

Writes tests/fixtures/qwen2_reference.safetensors,
qwen3_reference.safetensors and mistral_reference.safetensors, which
tests/suite/qwen_reference.rs compares
wgrad with. CI has no torch and never runs this; rerun it by hand after
changing anything it mirrors:

    python3 scripts/qwen_reference.py

Everything runs in float32; a float64 run only feeds the printout (the
rounding noise of the float32 numbers, and so the tolerance the Rust test
can afford).
"""

import math
import os

import torch
from transformers import (
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from reference_training import loss_of, max_diff, optimizer_meta, print_steps, step_tensors, train, write_fixture

# Grouped-query attention (4 heads over 2 KV heads), an intermediate width
# (172) and vocabularies (71, 67) that no tile divides.
BLOCK, N_LAYER, N_HEAD, N_KV_HEAD, N_EMBD, INTERMEDIATE = 16, 2, 4, 2, 64, 172
THETA, EPS_NORM = 10000.0, 1e-6
BATCH = 3
SEED = 2
CLIP = 1.5

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")

# variant: (config class, model class, vocabulary, head width, sliding window)
VARIANTS = {
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, 71, N_EMBD // N_HEAD, None),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, 67, 24, None),
    # Attends to the last 5 positions only (key j of query i when i - j < 5).
    "mistral": (MistralConfig, MistralForCausalLM, 73, N_EMBD // N_HEAD, 5),
}


def config(variant, tied, windowed=True):
    config_class, _, vocab, head_dim, window = VARIANTS[variant]
    # Qwen's configs slide only with use_sliding_window; Mistral's always
    # does where sliding_window is set.
    sliding = {"sliding_window": window if windowed else None} if window else {"use_sliding_window": False}
    return config_class(
        vocab_size=vocab, hidden_size=N_EMBD, intermediate_size=INTERMEDIATE, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=N_KV_HEAD, head_dim=head_dim, max_position_embeddings=BLOCK,
        rope_theta=THETA, rms_norm_eps=EPS_NORM, tie_word_embeddings=tied, **sliding,
        hidden_act="silu", initializer_range=0.02, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def build(variant, tied):
    """The model with transformers' init from the torch RNG's state, then
    noise on every vector (biases, norm weights)."""
    model_class = VARIANTS[variant][1]
    model = model_class._from_config(config(variant, tied), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return model


def forward(model, idx):
    return model(input_ids=idx, use_cache=False).logits


def decayed(name, p):
    """wgrad's decay_matrices_only groups: matrices that are not embedding
    tables decay; the token table, biases and norms do not."""
    return p.dim() >= 2 and "embed_tokens" not in name


def fresh(variant, tied, init, dtype):
    m = build(variant, tied).to(dtype)
    m.load_state_dict({n: v.to(dtype) for n, v in init.items()}, strict=False)
    return m


def reference(variant):
    vocab, head_dim, window = VARIANTS[variant][2:]
    gen = torch.Generator().manual_seed(SEED + 1)
    idx = torch.randint(0, vocab, (BATCH, BLOCK), generator=gen)
    # Each target is the token before it: something only attention learns.
    targets = idx.roll(1, dims=1)

    torch.manual_seed(SEED)
    model = build(variant, tied=False)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = forward(model, idx)
    loss = loss_of(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    model = fresh(variant, False, init, torch.float32)
    losses, norms = train(model, forward, idx, targets, groups=decayed, clip=CLIP)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}

    torch.manual_seed(SEED + 2)
    tied = build(variant, tied=True)
    tied_init = {n: p.detach().clone() for n, p in tied.named_parameters()}
    tied_logits = forward(tied, idx)
    tied_loss = loss_of(tied_logits, targets)
    tied_loss.backward()
    tied_grads = {n: p.grad.detach().clone() for n, p in tied.named_parameters()}

    m64 = fresh(variant, False, init, torch.float64)
    logits64 = forward(m64, idx)
    loss64 = loss_of(logits64, targets)
    loss64.backward()
    grad_noise = max(max_diff(grads[n], p.grad) for n, p in m64.named_parameters())
    m64 = fresh(variant, False, init, torch.float64)
    losses64, norms64 = train(m64, forward, idx, targets, groups=decayed, clip=CLIP)
    final64 = dict(m64.named_parameters())

    if window:
        unwindowed = VARIANTS[variant][1]._from_config(config(variant, False, windowed=False), attn_implementation="eager")
        unwindowed = unwindowed.float().eval()
        unwindowed.load_state_dict(init)
        with torch.no_grad():
            window_effect = max_diff(logits, forward(unwindowed, idx))
        print(f"the window moves the logits by {window_effect:.2e}")
        assert window_effect > 1e-3, "the window must matter in this fixture"
    print(f"{variant}: vocab {vocab}, positions {BLOCK}, window {window}, layers {N_LAYER}, heads {N_HEAD} of {head_dim} over "
          f"{N_KV_HEAD} KV heads, embd {N_EMBD}, intermediate {INTERMEDIATE}; batch {BATCH}")
    print(f"parameters: {sum(p.numel() for p in init.values())} untied, {sum(p.numel() for p in tied_init.values())} tied")
    print(f"initial loss {loss.item():.7f} (ln V = {math.log(vocab):.7f}), tied {tied_loss.item():.7f}")
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
        "tied.logits": tied_logits.detach(),
        "tied.loss": tied_loss.detach().reshape(1),
    }
    meta = {
        "variant": variant, "vocab_size": vocab, "block_size": BLOCK, "n_layer": N_LAYER, "n_head": N_HEAD,
        "n_kv_head": N_KV_HEAD, "head_dim": head_dim, "n_embd": N_EMBD, "intermediate_size": INTERMEDIATE,
        "rope_theta": THETA, "rms_norm_eps": EPS_NORM, **({"sliding_window": window} if window else {}),
        **optimizer_meta(CLIP),
    }
    named = {"init": init, "grad": grads, "final": final, "tied.init": tied_init, "tied.grad": tied_grads}
    write_fixture(os.path.join(FIXTURES, f"{variant}_reference.safetensors"), tensors, named, meta, clipped)


def main():
    torch.set_num_threads(1)
    for variant in VARIANTS:
        reference(variant)


if __name__ == "__main__":
    main()
