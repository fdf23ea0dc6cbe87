#!/usr/bin/env python3
"""llama.cpp's CPU speed on a GGUF file, the reference point beside
`wgrad bench --only smollm2` (issue 25): the same prompt length (seeded
random ids), greedy decoding with the KV cache, on `--threads` cores (2,
as LP_NUM_THREADS=2 gives lavapipe). Prints lines in `wgrad bench`'s
format:

    bench llamacpp_smollm2_prefill tokens_per_s=… prompt_tokens=…
    bench llamacpp_smollm2_decode tokens_per_s=… new_tokens=…

(`--family gemma3` names the lines `llamacpp_gemma3_…`, beside
`wgrad bench --only gemma3`: 128 prompt tokens and 32 new, as there.)

Prefill is one `eval` of the whole prompt after a warm-up run of the same;
decode is `--new-tokens` one-token `eval`s after it, each picking the
argmax of the last logits, timed one by one (the median, as wgrad's).
llama.cpp runs the file's Q4_1 and Q8_0 tensors as they are stored.

    pip install llama-cpp-python   # builds llama.cpp from source (minutes)
    python scripts/llamacpp_reference_speed.py --no-extra-buffer-types ~/.cache/wgrad/models/SmolLM2-135M-Instruct.Q4_1.gguf
"""

import argparse
import statistics
import time

import llama_cpp
import llama_cpp.llama
import numpy as np
from llama_cpp import Llama


def without_extra_buffer_types():
    """llama.cpp's model parameters with `use_extra_bufts` off: its CPU
    weight repacking (built with AMX when the build machine has it)
    crashed in the first `eval` on the KVM guest these numbers come from
    (a segmentation fault); the plain CPU kernels run the same file."""
    params = default_model_params()
    params.use_extra_bufts = False
    return params


default_model_params = llama_cpp.llama_model_default_params


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the GGUF file")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--family", default="smollm2", help="the name in the printed bench lines")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--no-extra-buffer-types", action="store_true", help="llama.cpp without its weight repacking (see without_extra_buffer_types)")
    args = parser.parse_args()

    if args.no_extra_buffer_types:
        llama_cpp.llama.llama_cpp.llama_model_default_params = without_extra_buffer_types
    llm = Llama(model_path=args.model, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=512, n_batch=512, verbose=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, llm.n_vocab(), args.prompt_tokens).tolist()

    def prefill():
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    prefill()  # warm-up: first touch of the weights
    seconds = prefill()
    vocab = llm.n_vocab()

    def greedy():
        # `eval` keeps no logits unless every position's are asked for:
        # the last position's, from the context.
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(vocab,))))

    steps = []
    token = greedy()
    for _ in range(args.new_tokens):
        start = time.perf_counter()
        llm.eval([token])
        token = greedy()
        steps.append(time.perf_counter() - start)
    # The same greedy loop on a real prompt: the words show the file runs right.
    llm.reset()
    llm.eval(llm.tokenize(b"The capital of France is", add_bos=False))
    words = [greedy()]
    for _ in range(5):
        llm.eval(words[-1:])
        words.append(greedy())
    print("check: The capital of France is" + llm.detokenize(words).decode("utf-8", "replace"))
    print(f"bench llamacpp_{args.family}_prefill tokens_per_s={args.prompt_tokens / seconds:.1f} prompt_tokens={args.prompt_tokens} threads={args.threads}")
    print(f"bench llamacpp_{args.family}_decode tokens_per_s={1 / statistics.median(steps):.2f} new_tokens={args.new_tokens} threads={args.threads}")


if __name__ == "__main__":
    main()
