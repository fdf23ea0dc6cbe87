#!/usr/bin/env python3
"""PyTorch reference for wgrad's Llama, the way llm.c's test_gpt2 checks
its model (as scripts/gpt_reference.py does for the GPT): one fixed batch,
the logits, the loss, every gradient, then 10 AdamW steps (weight decay on
the groups wgrad decays, gradient clipping, the warmup-cosine schedule) and
the parameters they end at; and a tied-head variant's logits, loss and
gradients.

The model is transformers' own LlamaForCausalLM (random init, eager
attention), so the names are Hugging Face's and the numbers are what users'
checkpoints compute. Writes tests/fixtures/llama_reference.safetensors,
which tests/suite/llama_reference.rs compares wgrad with. CI has no torch
and never runs this; rerun it by hand after changing anything it mirrors:

    python3 scripts/llama_reference.py

Everything runs in float32; a float64 run of the same steps only feeds the
printout, to show how much of the float32 numbers is rounding noise and so
what tolerance the Rust test can afford.
"""

import math
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from reference_training import loss_of, max_diff, optimizer_meta, print_steps, step_tensors, train, write_fixture

# Grouped-query attention (4 heads over 2 KV heads, head width 16), an
# intermediate width (172) and a vocabulary (67) that no tile divides.
VOCAB, BLOCK, N_LAYER, N_HEAD, N_KV_HEAD, N_EMBD, INTERMEDIATE = 67, 16, 2, 4, 2, 64, 172
THETA, EPS_NORM = 10000.0, 1e-5
BATCH = 3
SEED = 1337

# The optimizer's settings are reference_training's (as the GPT's),
# clipping at CLIP.
CLIP = 1.5

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "llama_reference.safetensors")


def config(tied):
    return LlamaConfig(
        vocab_size=VOCAB, hidden_size=N_EMBD, intermediate_size=INTERMEDIATE, num_hidden_layers=N_LAYER,
        num_attention_heads=N_HEAD, num_key_value_heads=N_KV_HEAD, max_position_embeddings=BLOCK,
        rope_theta=THETA, rms_norm_eps=EPS_NORM, tie_word_embeddings=tied, attention_bias=False, mlp_bias=False,
        hidden_act="silu", initializer_range=0.02, pad_token_id=None, bos_token_id=None, eos_token_id=None,
    )


def build(tied):
    """A LlamaForCausalLM with transformers' init from the torch RNG's state."""
    model = LlamaForCausalLM._from_config(config(tied), attn_implementation="eager")
    return model.float().eval()


def forward(model, idx):
    return model(input_ids=idx, use_cache=False).logits


def decayed(name, p):
    """wgrad's decay_matrices_only groups: matrices that are not embedding
    tables (the projections and an untied lm_head) decay; the token table
    (and so a head tied to it) and the norms do not."""
    return p.dim() >= 2 and "embed_tokens" not in name


def fit(model, idx, targets):
    """The ten steps with this model's groups, clipping at CLIP."""
    return train(model, forward, idx, targets, groups=decayed, clip=CLIP)


def fresh(tied, init, dtype):
    m = build(tied).to(dtype)
    m.load_state_dict({n: v.to(dtype) for n, v in init.items()}, strict=False)
    return m


def main():
    gen = torch.Generator().manual_seed(SEED + 1)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=gen)
    # Each target is the token before it: something only attention learns.
    targets = idx.roll(1, dims=1)

    torch.manual_seed(SEED)
    model = build(tied=False)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = forward(model, idx)
    loss = loss_of(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    model = fresh(False, init, torch.float32)
    losses, norms = fit(model, idx, targets)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}

    # The tied variant: lm_head is model.embed_tokens (one parameter).
    torch.manual_seed(SEED + 2)
    tied = build(tied=True)
    tied_init = {n: p.detach().clone() for n, p in tied.named_parameters()}
    tied_logits = forward(tied, idx)
    tied_loss = loss_of(tied_logits, targets)
    tied_loss.backward()
    tied_grads = {n: p.grad.detach().clone() for n, p in tied.named_parameters()}

    # Float64: the rounding noise of the float32 numbers above.
    m64 = fresh(False, init, torch.float64)
    logits64 = forward(m64, idx)
    loss64 = loss_of(logits64, targets)
    loss64.backward()
    grad_noise = max(max_diff(grads[n], p.grad) for n, p in m64.named_parameters())
    m64 = fresh(False, init, torch.float64)
    losses64, norms64 = fit(m64, idx, targets)
    final64 = dict(m64.named_parameters())

    print(f"config: vocab {VOCAB}, positions {BLOCK}, layers {N_LAYER}, heads {N_HEAD} over {N_KV_HEAD} KV heads, "
          f"embd {N_EMBD}, intermediate {INTERMEDIATE}, theta {THETA}; batch {BATCH}")
    print(f"parameters: {sum(p.numel() for p in init.values())} untied, {sum(p.numel() for p in tied_init.values())} tied")
    print(f"initial loss {loss.item():.7f} (ln V = {math.log(VOCAB):.7f}), tied {tied_loss.item():.7f}")
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
        "vocab_size": VOCAB, "block_size": BLOCK, "n_layer": N_LAYER, "n_head": N_HEAD, "n_kv_head": N_KV_HEAD,
        "n_embd": N_EMBD, "intermediate_size": INTERMEDIATE, "rope_theta": THETA, "rms_norm_eps": EPS_NORM,
        **optimizer_meta(CLIP),
    }
    named = {"init": init, "grad": grads, "final": final, "tied.init": tied_init, "tied.grad": tied_grads}
    write_fixture(OUT, tensors, named, meta, clipped)


if __name__ == "__main__":
    main()
