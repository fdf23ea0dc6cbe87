"""The training half of the PyTorch references (scripts/gpt_reference.py,
scripts/llama_reference.py), llm.c's test_gpt2 way: ten clipped AdamW steps
on one batch with wgrad's optimizer settings, parameter groups and
warmup-cosine schedule, and the fixture tensors and metadata that record
them. Each reference brings its model, its forward and its groups.
"""

import math
import os

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

# The optimizer wgrad's tests build: AdamW(LR).betas(BETAS).eps(EPS)
# .weight_decay(WEIGHT_DECAY).decay_matrices_only().clip_grad_norm(clip)
# .schedule(WarmupCosine { WARMUP, TOTAL, MIN_LR }). Ten steps go through the
# warmup (1-3), the cosine (4-8) and the floor after total_steps (9-10).
STEPS = 10
LR, MIN_LR = 3e-2, 3e-3
WARMUP, TOTAL = 3, 8
BETAS, EPS = (0.9, 0.95), 1e-8
WEIGHT_DECAY = 0.1


def loss_of(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_at(step):
    """wgrad's LrSchedule::WarmupCosine { WARMUP, TOTAL, MIN_LR }.lr_at(LR,
    step), step counted from 1: in float64, rounded once to float32 (what
    wgrad's optimizer reads)."""
    it = max(step, 1) - 1
    if it < WARMUP:
        rate = LR * (it + 1) / WARMUP
    elif it >= TOTAL:
        rate = MIN_LR
    else:
        ratio = (it - WARMUP) / (TOTAL - WARMUP)
        rate = MIN_LR + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (LR - MIN_LR)
    return float(torch.tensor(rate, dtype=torch.float32))


def train(model, forward, idx, targets, *, groups, clip, scheduled=True):
    """STEPS AdamW steps on the one batch, as wgrad's Trainer runs them:
    forward, backward, clip to `clip`, set the step's learning rate, update;
    `groups(name, p)` says which parameters decay. Returns the loss before
    each update and the gradient norm clip_grad_norm_ saw."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if groups(n, p)]
    no_decay = [p for n, p in named if not groups(n, p)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR, betas=BETAS, eps=EPS, foreach=False, fused=False,
    )
    losses, norms = [], []
    for step in range(1, STEPS + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(forward(model, idx), targets)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=False)
        for group in opt.param_groups:
            group["lr"] = lr_at(step) if scheduled else LR
        opt.step()
        losses.append(loss.item())
        norms.append(norm.item())
    return losses, norms


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def print_steps(losses, norms, clip):
    """The step table; returns the clipped steps, asserting clipping acted
    on some steps and not on others (so the test sees both)."""
    print("step  lr          loss       grad norm  clipped")
    for s, (l, g) in enumerate(zip(losses, norms), start=1):
        print(f"{s:4}  {lr_at(s):.8f}  {l:.7f}  {g:.6f}   {'yes' if g > clip else 'no'}")
    clipped = [s for s, g in enumerate(norms, start=1) if g > clip]
    assert 0 < len(clipped) < STEPS, "clipping should act on some steps and not on others"
    return clipped


def step_tensors(losses, norms):
    """The fixture's per-step tensors the Rust tests' `check_steps` reads."""
    return {
        "step_losses": torch.tensor(losses, dtype=torch.float32),
        "step_grad_norms": torch.tensor(norms, dtype=torch.float32),
        "step_lrs": torch.tensor([lr_at(s) for s in range(1, STEPS + 1)], dtype=torch.float32),
    }


def optimizer_meta(clip):
    """The optimizer's settings, stored in the fixture so the Rust test
    cannot drift from what made the numbers."""
    return {
        "lr": LR, "min_lr": MIN_LR, "warmup_steps": WARMUP, "total_steps": TOTAL,
        "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS, "weight_decay": WEIGHT_DECAY, "clip_grad_norm": clip,
    }


def write_fixture(out, tensors, named, meta, clipped):
    """Saves the fixture at `out`: `tensors`, each dict of `named` under its
    prefix (`grad.` + the parameter's name, …), and `meta` as metadata."""
    for prefix, values in named.items():
        tensors.update({f"{prefix}.{n}": v for n, v in values.items()})
    os.makedirs(os.path.dirname(out), exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, out, metadata={k: repr(v) for k, v in meta.items()})
    print(f"wrote {os.path.normpath(out)} ({os.path.getsize(out)} bytes); clipped on steps {clipped}")
