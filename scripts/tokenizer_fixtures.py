#!/usr/bin/env python3
"""Writes the tokenizer fixtures under tests/fixtures/tokenizers/: small GGUF files that carry a
model's tokenizer (and no tensors), and for each, the ids, decoded text and rendered chat templates
that Hugging Face transformers gives for the committed corpus (corpus.jsonl, one JSON string per
line, so tabs, CR and NUL survive). tests/suite/tokenizer.rs checks wgrad's tokenizer against them.

    pip install transformers gguf sentencepiece     # no torch needed (see load_reference)
    python scripts/tokenizer_fixtures.py             # the small files
    python scripts/tokenizer_fixtures.py --gemma3 "$(scripts/fetch-gemma3.sh)"
                                                     # also the real Gemma 3 file's ids

The files, each a vocabulary of its own trained here on Shakespeare plus the corpus:
- spm-llama.gguf: SentencePiece BPE as Llama 2 / TinyLlama ship it (`tokenizer.ggml.model = llama`,
  scores, byte fallback `<0xNN>`, `▁` for spaces, a space put before the text, BOS added);
- spm-mistral.gguf: the same vocabulary under `general.name = Mistral …` (transformers reads it as a
  Mistral model);
- spm-gemma3.gguf: Gemma's layout (<pad> 0, <eos> 1, <bos> 2, <unk> 3, <mask> 4; no space prefix; runs of spaces and
  newlines as user-defined tokens, the space runs spelled with real spaces as Gemma's GGUF files
  do; `<start_of_turn>`/`<end_of_turn>` control tokens) with Gemma 3's chat template;
- qwen2-bpe.gguf: byte-level BPE with merges and `tokenizer.ggml.pre = qwen2`, ChatML specials and
  Qwen2.5's chat template.
"""

import argparse
import gzip
import hashlib
import io
import json
import os
import sys
import tempfile
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizers")
SHAKESPEARE_LINES = 4000
SPM_VOCAB = 1200
BPE_VOCAB = 1000

# Gemma 3's chat template (google/gemma-3-*-it, tokenizer_config.json; llama.cpp carries the same).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    "    {%- set first_user_prefix = \"\" -%}\n"
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "        {{ raise_exception(\"Conversation roles must alternate user/assistant/user/assistant/...\") }}\n"
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    "        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n"
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\n'}}\n"
    "{%- endif -%}\n"
)

# Qwen2.5-*-Instruct's chat template (tokenizer_config.json), as the JSON string it is stored as there.
QWEN25_TEMPLATE = json.loads(r'''"{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n            {{- tool_call.name }}\n            {{- '\", \"arguments\": ' }}\n            {{- tool_call.arguments | tojson }}\n            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"''')

CHATS = [
    {"messages": [{"role": "user", "content": "Hello! Write a haiku about the sea."}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "You answer in French."},
                  {"role": "user", "content": "  What is 2 + 2?  "},
                  {"role": "assistant", "content": "Quatre. 🙂"},
                  {"role": "user", "content": "Et 3 × 3 ?\n\nMerci."}], "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "日本語で答えて。"},
                  {"role": "assistant", "content": "はい、わかりました。"}], "add_generation_prompt": False},
]

# Qwen 2's split, as transformers' Qwen2Tokenizer and llama.cpp's `qwen2` pre-tokenizer give it.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus():
    with open(os.path.join(OUT, "corpus.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def training_text(lines):
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt", encoding="utf-8") as f:
        shakespeare = [next(f).rstrip("\n") for _ in range(SHAKESPEARE_LINES)]
    # The corpus several times over, so its scripts get pieces of their own; NUL cannot be in a
    # sentencepiece training line.
    extra = [line.replace("\0", "") for line in lines for _ in range(3)]
    return [line for line in shakespeare + extra if line.strip()]


def train_spm(lines, gemma):
    """A SentencePiece BPE model with byte fallback, as Llama's and Gemma's are."""
    import sentencepiece as spm

    model = io.BytesIO()
    options = dict(
        model_type="bpe", vocab_size=SPM_VOCAB, byte_fallback=True, split_digits=True, character_coverage=0.995,
        normalization_rule_name="identity", remove_extra_whitespaces=False, allow_whitespace_only_pieces=True,
        max_sentencepiece_length=16, num_threads=1, minloglevel=2,
    )
    if gemma:
        options.update(pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>",
                       bos_piece="<bos>", unk_piece="<unk>", add_dummy_prefix=False,
                       control_symbols=["<mask>", "<start_of_turn>", "<end_of_turn>"],
                       user_defined_symbols=["\n", "\n\n", "\n\n\n", "▁▁", "▁▁▁", "▁▁▁▁", "[multimodal]"])
    else:
        options.update(unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(training_text(lines)), model_writer=model, **options)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def spm_vocabulary(sp, gemma):
    """Tokens, scores and llama.cpp token types (1 normal, 2 unknown, 3 control, 4 user-defined, 6 byte)."""
    tokens, scores, types_ = [], [], []
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if sp.is_unknown(i):
            kind = 2
        elif sp.is_control(i):
            kind = 3
        elif sp.is_byte(i):
            kind = 6
        elif sp.is_unused(i):
            kind = 5
        elif piece in ("\n", "\n\n", "\n\n\n", "▁▁", "▁▁▁", "▁▁▁▁", "[multimodal]"):
            kind = 4
        else:
            kind = 1
        if gemma and kind == 4 and set(piece) == {"▁"}:
            piece = " " * len(piece)  # Gemma's GGUF files spell runs of spaces with spaces
        tokens.append(piece)
        scores.append(sp.get_score(i))
        types_.append(kind)
    return tokens, scores, types_


def writer(path, arch, name):
    import gguf

    w = gguf.GGUFWriter(path, arch)
    w.add_name(name)
    # The sizes transformers' config reader wants; the files hold no tensors.
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_block_count(1)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    return w


def finish(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_spm(path, arch, name, tokens, scores, types_, gemma, template):
    w = writer(path, arch, name)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types_)
    if gemma:
        w.add_bos_token_id(2)
        w.add_eos_token_id(1)
        w.add_unk_token_id(3)
        w.add_pad_token_id(0)
        w.add_add_space_prefix(False)
    else:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_space_prefix(True)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    if template is not None:
        w.add_chat_template(template)
    finish(w)


def train_qwen2_bpe(lines):
    """A byte-level BPE vocabulary trained with Qwen 2's split, ChatML specials last as in Qwen's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(lines), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    tokens = [t for t, _ in vocab]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    types_ = [1] * len(tokens) + [3] * len(specials)
    return tokens + specials, merges, types_


def write_qwen2(path, tokens, merges, types_):
    w = writer(path, "qwen2", "Qwen2.5 tiny tokenizer fixture")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types_)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(QWEN25_TEMPLATE)
    finish(w)


def load_reference(path):
    """transformers' tokenizer for a GGUF file, exactly as `AutoTokenizer.from_pretrained(dir,
    gguf_file=…)` builds it. Without torch, a stand-in module lets transformers' GGUF reader import:
    the tokenizer path reads metadata only and never touches a tensor."""
    try:
        import torch  # noqa: F401
    except ImportError:
        import importlib.machinery

        class Stub(types.ModuleType):
            def __getattr__(self, name):
                if name.startswith("__"):
                    raise AttributeError(name)
                value = type(name, (), {})
                setattr(self, name, value)
                return value

        stub = Stub("torch")
        stub.__spec__ = importlib.machinery.ModuleSpec("torch", None)
        sys.modules["torch"] = stub
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_utils.is_torch_available = lambda: True
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def reference(path, lines, template):
    """What transformers gives for the file: ids with and without special tokens, the decoded text, and
    the chats rendered through `template` (none when it is None) and tokenized."""
    import transformers

    tok = load_reference(path)
    cases = []
    for text in lines:
        ids = tok.encode(text, add_special_tokens=False)
        cases.append({
            "text": text,
            "ids": ids,
            "ids_with_special": tok.encode(text, add_special_tokens=True),
            "decoded": tok.decode(ids),
            "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
        })
    chats = []
    for chat in CHATS if template is not None else []:
        rendered = tok.apply_chat_template(chat["messages"], chat_template=template, tokenize=False,
                                           add_generation_prompt=chat["add_generation_prompt"])
        chats.append(dict(chat, rendered=rendered, ids=tok.encode(rendered, add_special_tokens=False)))
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    return {
        "file": os.path.basename(path),
        "sha256": digest,
        "transformers": transformers.__version__,
        "tokenizer_class": type(tok).__name__,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "cases": cases,
        "chat_template": template,
        "chats": chats,
    }


def dump(name, value):
    with open(os.path.join(OUT, name), "w", encoding="utf-8", newline="\n") as f:
        json.dump(value, f, indent=1, ensure_ascii=False)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gemma3", help="the real gemma-3-270m-q4_k_m.gguf: also write gemma3-270m-tokenizer.json")
    parser.add_argument("--only-reference", action="store_true", help="keep the committed GGUF files")
    args = parser.parse_args()
    lines = corpus()
    if not args.only_reference:
        sp = train_spm(lines, gemma=False)
        tokens, scores, types_ = spm_vocabulary(sp, gemma=False)
        write_spm(os.path.join(OUT, "spm-llama.gguf"), "llama", "TinyLlama-style tokenizer fixture",
                  tokens, scores, types_, gemma=False, template=None)
        write_spm(os.path.join(OUT, "spm-mistral.gguf"), "llama", "Mistral-style tokenizer fixture",
                  tokens, scores, types_, gemma=False, template=None)
        sp = train_spm(lines, gemma=True)
        tokens, scores, types_ = spm_vocabulary(sp, gemma=True)
        write_spm(os.path.join(OUT, "spm-gemma3.gguf"), "gemma3", "Gemma 3 tokenizer fixture",
                  tokens, scores, types_, gemma=True, template=GEMMA3_TEMPLATE)
        write_qwen2(os.path.join(OUT, "qwen2-bpe.gguf"), *train_qwen2_bpe(lines))
    # Chats render through the template a file carries (the Llama-style ones carry none); the real
    # Gemma 3 file is the base model, without one, so its chats use the instruction-tuned model's.
    templates = {"spm-llama": None, "spm-mistral": None, "spm-gemma3": GEMMA3_TEMPLATE, "qwen2-bpe": QWEN25_TEMPLATE}
    for name, template in templates.items():
        path = os.path.join(OUT, name + ".gguf")
        dump(name + ".json", reference(path, lines, template))
        print(f"{name}: {os.path.getsize(path)} bytes", file=sys.stderr)
    if args.gemma3:
        dump("gemma3-270m-tokenizer.json", reference(args.gemma3, lines, GEMMA3_TEMPLATE))


if __name__ == "__main__":
    main()
