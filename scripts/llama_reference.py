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
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

# Grouped-query attention (4 heads over 2 KV heads, head width 16), an
# intermediate width (172) and a vocabulary (67) that no tile divides.
VOCAB, BLOCK, N_LAYER, N_HEAD, N_KV_HEAD, N_EMBD, INTERMEDIATE = 67, 16, 2, 4, 2, 64, 172
THETA, EPS_NORM = 10000.0, 1e-5
BATCH = 3
SEED = 1337

# The optimizer wgrad's test builds (as the GPT's): AdamW(LR).betas(BETAS)
# .eps(EPS).weight_decay(WEIGHT_DECAY).decay_matrices_only()
# .clip_grad_norm(CLIP).schedule(WarmupCosine { WARMUP, TOTAL, MIN_LR }).
STEPS = 10
LR, MIN_LR = 3e-2, 3e-3
WARMUP, TOTAL = 3, 8
BETAS, EPS = (0.9, 0.95), 1e-8
WEIGHT_DECAY = 0.1
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


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def forward(model, idx):
    return model(input_ids=idx, use_cache=False).logits


def lr_at(step):
    """wgrad's LrSchedule::WarmupCosine, step from 1, in float64 rounded once to float32."""
    it = max(step, 1) - 1
    if it < WARMUP:
        rate = LR * (it + 1) / WARMUP
    elif it >= TOTAL:
        rate = MIN_LR
    else:
        ratio = (it - WARMUP) / (TOTAL - WARMUP)
        rate = MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)
    return float(torch.tensor(rate, dtype=torch.float32))


def decayed(name, p):
    """wgrad's decay_matrices_only groups: matrices that are not embedding
    tables (the projections and an untied lm_head) decay; the token table
    (and so a head tied to it) and the norms do not."""
    return p.dim() >= 2 and "embed_tokens" not in name


def train(model, idx, targets):
    named = list(model.named_parameters())
    decay = [p for n, p in named if decayed(n, p)]
    no_decay = [p for n, p in named if not decayed(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=False, fused=False,
    )
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward(model, idx), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP, foreach=False)
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


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
    losses, norms = train(model, idx, targets)
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
    losses64, norms64 = train(m64, idx, targets)
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
    print("step  lr          loss       grad norm  clipped")
    for s, (l, g) in enumerate(zip(losses, norms), start=1):
        print(f"{s:4}  {lr_at(s):.8f}  {l:.7f}  {g:.6f}   {'yes' if g > CLIP else 'no'}")
    clipped = [s for s, g in enumerate(norms, start=1) if g > CLIP]
    assert 0 < len(clipped) < STEPS, "clipping should act on some steps and not on others"

    tensors = {
        "idx": idx.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach(),
        "loss": loss.detach().reshape(1),
        "step_losses": torch.tensor(losses, dtype=torch.float32),
        "step_grad_norms": torch.tensor(norms, dtype=torch.float32),
        "step_lrs": torch.tensor([lr_at(s) for s in range(1, STEPS + 1)], dtype=torch.float32),
        "tied.logits": tied_logits.detach(),
        "tied.loss": tied_loss.detach().reshape(1),
    }
    tensors.update({f"init.{n}": v for n, v in init.items()})
    tensors.update({f"grad.{n}": v for n, v in grads.items()})
    tensors.update({f"final.{n}": v for n, v in final.items()})
    tensors.update({f"tied.init.{n}": v for n, v in tied_init.items()})
    tensors.update({f"tied.grad.{n}": v for n, v in tied_grads.items()})
    meta = {
        "vocab_size": VOCAB, "block_size": BLOCK, "n_layer": N_LAYER, "n_head": N_HEAD, "n_kv_head": N_KV_HEAD,
        "n_embd": N_EMBD, "intermediate_size": INTERMEDIATE, "rope_theta": THETA, "rms_norm_eps": EPS_NORM,
        "lr": LR, "min_lr": MIN_LR, "warmup_steps": WARMUP, "total_steps": TOTAL,
        "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS, "weight_decay": WEIGHT_DECAY, "clip_grad_norm": CLIP,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, OUT, metadata={k: repr(v) for k, v in meta.items()})
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes); clipped on steps {clipped}")


if __name__ == "__main__":
    main()
