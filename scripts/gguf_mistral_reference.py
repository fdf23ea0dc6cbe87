#!/usr/bin/env python3
"""Writes tests/fixtures/gguf-mistral-greedy.json for cli/tests/cli_mistral.rs:
transformers' greedy continuation of a prompt longer than the sliding
window by the Mistral GGUF fixture (tests/fixtures/gguf-mistral.gguf, the
tiny Llama of gguf-llama.gguf with `llama.attention.sliding_window` = 3,
as llama.cpp stores a Mistral), and the same prompt's continuation
without the window (the Llama file), which differs: the window takes
effect in generation.

transformers reads the file as a Llama (its GGUF loader de-quantizes every
tensor and undoes the converter's q/k permutation, and knows no window for
`llama`), so its weights are loaded into a MistralForCausalLM of the same
sizes with `sliding_window` = 3 (Mistral's parameter names are Llama's).
Each greedy step's top-two margin is checked to be large enough that
float32 rounding (wgrad's quantized kernels against torch's de-quantized
matmuls) cannot flip it.

    python3 scripts/gguf_mistral_reference.py
"""

import json
import pathlib

import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
WINDOW = 3
# 9 positions, three windows' worth: the BOS then token ids of the tiny
# byte-level vocabulary.
PROMPT = [1, 87, 105, 110, 100, 111, 119, 115, 33]
NEW_TOKENS = 12
MIN_MARGIN = 1e-3


def greedy(model, name):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    ids = out.sequences[0, len(PROMPT):].tolist()
    for step, logits in enumerate(out.logits):
        top = torch.topk(logits[0].float(), 2).values
        margin = float(top[0] - top[1])
        assert margin > MIN_MARGIN, f"{name}: greedy step {step} has a margin of {margin}; choose another prompt"
    print(f"{name}: greedy {ids}")
    return ids


def main():
    torch.manual_seed(0)
    llama = AutoModelForCausalLM.from_pretrained(str(FIXTURES), gguf_file="gguf-mistral.gguf", dtype=torch.float32)
    llama.eval()
    c = llama.config
    assert c.model_type == "llama", c
    config = MistralConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.hidden_size // c.num_attention_heads,
        max_position_embeddings=c.max_position_embeddings,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=c.rope_parameters,
        tie_word_embeddings=c.tie_word_embeddings,
        sliding_window=WINDOW,
        attn_implementation="eager",
    )
    mistral = MistralForCausalLM(config)
    missing, unexpected = mistral.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    mistral.eval()
    windowed = greedy(mistral, "mistral (window 3)")
    full = greedy(llama, "llama (no window)")
    assert windowed != full, "the window changes nothing here; choose another prompt"
    out = FIXTURES / "gguf-mistral-greedy.json"
    out.write_text(json.dumps({"window": WINDOW, "prompt": PROMPT, "greedy": windowed, "greedy_without_window": full}) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
