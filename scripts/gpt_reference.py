#!/usr/bin/env python3
"""PyTorch reference for wgrad's GPT, the way llm.c's test_gpt2 checks its
model: one fixed batch, the logits, the loss, every gradient, then 10 AdamW
steps (weight decay on the groups wgrad decays, gradient clipping, the
warmup-cosine schedule) and the parameters they end at.

Writes tests/fixtures/gpt_reference.safetensors, which
tests/suite/gpt_reference.rs compares wgrad with. CI has no torch and never
runs this; rerun it by hand after changing anything it mirrors:

    /work/venv/bin/python scripts/gpt_reference.py

The model is written here (nanoGPT's architecture) with wgrad's parameter
names, so the state_dict keys are the names wgrad's graph gives. Everything
runs in float32; a float64 run of the same steps only feeds the printout,
to show how much of the float32 numbers is rounding noise and so what
tolerance the Rust test can afford.
"""

import math
import os
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from reference_training import loss_of, max_diff, optimizer_meta, print_steps, step_tensors, train, write_fixture

# Sizes with primes and a head width (24 / 3 = 8) that no tile divides
# evenly into the others: vocab 29, block 11.
VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD = 29, 11, 2, 3, 24
BATCH = 3
# A second, shorter sequence: the position table is sliced to its first rows.
SHORT_T = 7
SEED = 1337

# The optimizer's settings are reference_training's, clipping at CLIP.
CLIP = 1.0

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gpt_reference.safetensors")


@dataclass(frozen=True)
class GptConfig:
    """wgrad's GptConfig."""
    vocab_size: int
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_head, self.n_embd = cfg.n_head, cfg.n_embd
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.c_proj(y)


class Mlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = Mlp(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Gpt(nn.Module):
    """nanoGPT's GPT with wgrad's (GPT-2's) names at the top level: wte, wpe,
    h.N, ln_f; the head is wte itself (tied, no bias)."""

    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        # nanoGPT's _init_weights, then the scaled residual projections.
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx):
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T


def tiny():
    """The test's model, GPT-2 init from the torch RNG's current state."""
    return Gpt(GptConfig(VOCAB, BLOCK, N_LAYER, N_HEAD, N_EMBD))


def decayed(name, p):
    """wgrad's decay_matrices_only groups: only parameters of 2 or more
    dimensions that are not embedding tables (Linear weights) decay. The
    tied head is wte, so it does not decay either. (nanoGPT's own groups
    also decay the embeddings; wgrad follows minGPT here.)"""
    return p.dim() >= 2 and not name.startswith(("wte.", "wpe."))


def forward(model, idx):
    return model(idx)


def fit(model, idx, targets, *, scheduled=True, groups=decayed, clip=True):
    """The ten steps with this model's groups and clipping (or none)."""
    return train(model, forward, idx, targets, groups=groups, clip=CLIP if clip else float("inf"), scheduled=scheduled)


def key_bias(name):
    """The key third of c_attn.bias: adding a constant vector to every key
    adds q·b to a whole row of scores, which the softmax ignores. Its
    gradient is exactly 0 and what reaches Adam is rounding noise, which
    Adam scales up to steps of about lr, so its final values are noise."""
    return slice(N_EMBD, 2 * N_EMBD) if name.endswith("attn.c_attn.bias") else None


def params_diff(a, b, keys):
    """Largest difference over the parameters outside the key biases
    (keys=False), or over the key biases alone (keys=True)."""
    worst = 0.0
    for n in a:
        cut = key_bias(n)
        if keys and cut is not None:
            worst = max(worst, max_diff(a[n][cut], b[n][cut]))
        elif not keys:
            mask = torch.ones(a[n].shape[0], dtype=torch.bool)
            if cut is not None:
                mask[cut] = False
            worst = max(worst, max_diff(a[n][mask], b[n][mask]))
    return worst


def main():
    torch.manual_seed(SEED)
    model = tiny()
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    # A fixed batch with something to learn that needs attention: each
    # target is the token before it (the first position's, the row's last).
    gen = torch.Generator().manual_seed(SEED + 1)
    idx = torch.randint(0, VOCAB, (BATCH, BLOCK), generator=gen)
    targets = idx.roll(1, dims=1)

    def fresh(dtype):
        m = tiny().to(dtype)
        m.load_state_dict({n: v.to(dtype) for n, v in init.items()})
        return m

    # The forward and the gradients at the initial weights.
    logits = model(idx)
    loss = loss_of(logits, targets)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    short_logits = model(idx[:, :SHORT_T])
    model.zero_grad(set_to_none=True)
    short_loss = loss_of(short_logits, targets[:, :SHORT_T])
    short_loss.backward()
    short_grads = {n: model.get_parameter(n).grad.detach().clone() for n in ("wte.weight", "wpe.weight")}

    # Ten steps from the same weights.
    model = fresh(torch.float32)
    losses, norms = fit(model, idx, targets)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}

    # Float64 versions: rounding noise of the float32 numbers above.
    m64 = fresh(torch.float64)
    logits64 = m64(idx)
    loss64 = loss_of(logits64, targets)
    loss64.backward()
    grad_noise = max(max_diff(grads[n], p.grad) for n, p in m64.named_parameters())
    m64 = fresh(torch.float64)
    losses64, norms64 = fit(m64, idx, targets)
    final64 = dict(m64.named_parameters())

    print(f"config: vocab {VOCAB}, block {BLOCK}, layers {N_LAYER}, heads {N_HEAD}, embd {N_EMBD}; batch {BATCH}, short T {SHORT_T}")
    print(f"parameters: {sum(p.numel() for p in init.values())}")
    print(f"initial loss {loss.item():.7f} (ln V = {math.log(VOCAB):.7f}), short-sequence loss {short_loss.item():.7f}")
    print("float32 against float64 (the noise floor):")
    print(f"  logits {max_diff(logits, logits64):.2e}, loss {abs(loss.item() - loss64.item()):.2e}, gradients {grad_noise:.2e}")
    print(f"  step losses {max(abs(a - b) for a, b in zip(losses, losses64)):.2e}, "
          f"final parameters {params_diff(final, final64, False):.2e} (key biases {params_diff(final, final64, True):.2e})")
    clipped = print_steps(losses, norms, CLIP)
    # How far each thing the test guards moves the results (float64, so
    # none of it is noise): each must exceed the test's tolerances.
    print("what a wrong setting changes (float64):")
    variants = {
        "constant lr (no schedule)": dict(scheduled=False),
        "nanoGPT's groups (embeddings decay too)": dict(groups=lambda n, p: p.dim() >= 2),
        "decay on every parameter": dict(groups=lambda n, p: True),
        "no clipping": dict(clip=False),
    }
    for what, kwargs in variants.items():
        m = fresh(torch.float64)
        l, _ = fit(m, idx, targets, **kwargs)
        p = dict(m.named_parameters())
        print(f"  {what}: step losses {max(abs(a - b) for a, b in zip(l, losses64)):.2e}, "
              f"final parameters {params_diff(p, final64, False):.2e}")

    tensors = {
        "idx": idx.to(torch.int32),
        "targets": targets.to(torch.int32),
        "logits": logits.detach(),
        "loss": loss.detach().reshape(1),
        "short.logits": short_logits.detach(),
        "short.loss": short_loss.detach().reshape(1),
        **step_tensors(losses, norms),
    }
    # The settings, so the Rust test cannot drift from what made the numbers.
    meta = {
        "vocab_size": VOCAB, "block_size": BLOCK, "n_layer": N_LAYER, "n_head": N_HEAD, "n_embd": N_EMBD,
        "short_t": SHORT_T, **optimizer_meta(CLIP),
    }
    named = {"init": init, "grad": grads, "short.grad": short_grads, "final": final}
    write_fixture(OUT, tensors, named, meta, clipped)


if __name__ == "__main__":
    main()
