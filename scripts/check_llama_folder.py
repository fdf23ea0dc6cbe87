#!/usr/bin/env python3
"""Opens a wgrad Llama folder with transformers (LlamaForCausalLM, picked
by config.json) and compares its logits with the ones wgrad computed:

    cargo run --release --example llama_folder -- out/llama-folder
    python3 scripts/check_llama_folder.py out/llama-folder [LOGITS] [--atol 1e-4]

The other direction (folders `save_pretrained` wrote, loaded by wgrad) is
tests/suite/llama_folder.rs over scripts/make_llama_fixture.py's fixtures.
The check itself is check_hf_folder.py's, shared with the GPT.
"""

import sys

from check_hf_folder import main

if __name__ == "__main__":
    sys.exit(main())
