#!/usr/bin/env python3
"""Writes tests/fixtures/smollm2-tokenizer.json: SmolLM2-135M-Instruct's token
ids for a few hundred lines of text, and its chat template rendered for two
conversations, computed by Hugging Face's reference tokenizer. The suite's
tokenizer tests (tests/suite/tokenizer.rs) compare wgrad's tokenizer, built
from the same GGUF file, with these ids.

    pip install transformers gguf     # no torch needed
    scripts/fetch-smollm2.sh           # prints the GGUF path
    python scripts/tokenizer_reference.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf

The reference is transformers' GGUF conversion (`AutoTokenizer` with
`gguf_file=`), with one correction: transformers has no entry for the
file's pre-tokenizer `smollm` and falls back to GPT-2's split, while
SmolLM2's own tokenizer.json and llama.cpp split every digit alone first
(`Digits(individual_digits=True)`, then byte-level). The script prints how
many lines the two splits disagree on.
"""

import gzip
import hashlib
import json
import os
import sys

from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "fixtures", "smollm2-tokenizer.json")
SHAKESPEARE_LINES = 200

NON_ASCII = [
    "Café crème brûlée, naïve façade, coöperate, jalapeño, Ærøskøbing.",
    "Größe, Straße, Übermut und Öl — «guillemets» et “quotes” ‘single’.",
    "Zażółć gęślą jaźń. Příliš žluťoučký kůň úpěl ďábelské ódy.",
    "Tiếng Việt có dấu: Hà Nội, Thành phố Hồ Chí Minh.",
    "Съешь же ещё этих мягких французских булок, да выпей чаю.",
    "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
    "我能吞下玻璃而不伤身体。",
    "日本語のテキスト：こんにちは、世界！カタカナとひらがな。",
    "한국어 문장입니다. 안녕하세요!",
    "مرحبا بالعالم، هذه جملة عربية.",
    "שלום עולם, זה משפט בעברית.",
    "नमस्ते दुनिया, यह हिंदी है।",
    "สวัสดีชาวโลก ภาษาไทย",
    "Emoji: 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷🇯🇵 ❤️ 🦀",
    "🙂",
    "a🙂b",
    "Math: x² + y² = z², ½ + ¼ = ¾, ∑ᵢ aᵢ ≤ ∞, √2 ≈ 1.414, π ≠ 3.",
    "Roman numerals Ⅻ and Ⅳ, fullwidth １２３ and ＡＢＣ, Arabic-Indic ٣٤٥ and Devanagari ४२.",
    "Currency: €100, £20, ¥3000, ₹50, ₿0.5",
    "Zero-width: a\u200bb, soft\u00adhyphen, non\u00a0breaking space.",
    "Combining: e\u0301 vs é, n\u0303 vs ñ.",
    "\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9\u00e9",
    "İstanbul ıiİI ǅ ß ẞ ﬁ",
    "Ελληνικά, русский, 中文, العربية in one line.",
]

WHITESPACE = [
    "",
    " ",
    "  ",
    "    leading spaces",
    "trailing spaces    ",
    "a  b   c    d",
    "\ttab\tseparated\t\tvalues",
    "line one\nline two\n\nline four",
    "windows\r\nline\r\nends",
    "\n\n\n",
    "  \n  \n",
    "mixed \t \n whitespace",
    " a",
    "a ",
]

DIGITS = [
    "0",
    "12345",
    "3.14159265358979",
    "1,000,000 and 1_000_000",
    "2024-12-05T13:45:00Z",
    "Call 555-0123 or +1 (800) 123-4567.",
    "version v1.2.3-rc.4",
    "0x1F 0b1010 1e-9 6.022e23",
    " 42 apples",
    "room 101, 7 days, 365 nights, 2048 bits",
]

CODE = [
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "fn main() {\n    println!(\"Hello, world! {}\", 1 + 2);\n}",
    '{"name": "SmolLM2", "layers": 30, "tied": true, "eps": 1e-5}',
    "<div class=\"box\"><a href='https://example.com/?q=1&r=2'>link</a></div>",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name;",
    "x = [i**2 for i in range(10) if i % 2 == 0]  # squares",
    "#include <stdio.h>\n\nint main(void) { return 0; }",
    "$ cargo test --release -- --nocapture 2>&1 | tee log.txt",
    "I'm sure you're right; it's what they'll say, we'd agree, I've seen it. DON'T SHOUT.",
    "!!! ??? ... --- *** ### @@@ %%% ^^^ &&& ||| ~~~ ``` ''' \"\"\"",
]

SPECIAL = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n",
    "<|im_start|>assistant\nParis.<|im_end|>",
    "<|endoftext|>",
    "before<|endoftext|>after",
    "a<|im_end|>b<|im_start|>c",
    "<|im_start|> spaced <|im_end|>",
    "<repo_name>wgrad<file_sep>src/lib.rs<filename>",
    "not special: <|im_sta and <|im_end| and <im_start>",
    "<|im_start|><|im_start|><|im_end|><|im_end|>",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant. Answer in one word."},
        {"role": "user", "content": "What is the capital of France?"},
        {"role": "assistant", "content": "Paris."},
        {"role": "user", "content": "And of Japan? 日本"},
    ],
]


def shakespeare_lines():
    with gzip.open(os.path.join(ROOT, "data", "shakespeare.txt.gz"), "rt", encoding="utf-8") as f:
        lines = [line.rstrip("\n") for line in f if line.strip()]
    step = len(lines) // SHAKESPEARE_LINES
    return [lines[i * step] for i in range(SHAKESPEARE_LINES)]


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    path = os.path.abspath(sys.argv[1])
    with open(path, "rb") as f:
        sha256 = hashlib.sha256(f.read()).hexdigest()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    backend = tok.backend_tokenizer
    gpt2_split = backend.pre_tokenizer
    smollm_split = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )

    texts = shakespeare_lines() + NON_ASCII + WHITESPACE + DIGITS + CODE + SPECIAL
    backend.pre_tokenizer = gpt2_split
    plain = [tok.encode(t, add_special_tokens=False) for t in texts]
    backend.pre_tokenizer = smollm_split
    cases = []
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text, f"the reference does not round-trip {text!r}"
        cases.append({"text": text, "ids": ids})
    differ = sum(p != c["ids"] for p, c in zip(plain, cases))
    print(f"{len(cases)} lines; transformers' GPT-2 split differs from smollm's on {differ}", file=sys.stderr)

    chats = []
    for messages in CONVERSATIONS:
        rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        chats.append(
            {
                "messages": messages,
                "add_generation_prompt": True,
                "rendered": rendered,
                "ids": tok.encode(rendered, add_special_tokens=False),
            }
        )

    fixture = {
        "source": "scripts/tokenizer_reference.py",
        "gguf": os.path.basename(path),
        "gguf_sha256": sha256,
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "cases": cases,
        "chats": chats,
    }
    with open(OUT, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {OUT} ({os.path.getsize(OUT)} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
