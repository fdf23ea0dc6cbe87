#!/usr/bin/env python3
"""Checks a GGUF file `wgrad export --format gguf` wrote: gguf-py reads it
and finds the base file's metadata and tensors, and llama.cpp (through
llama-cpp-python) runs it with the same greedy tokens as wgrad.

    wgrad export --model BASE.gguf --lora ADAPTER --out merged.gguf --type q8_0
    python3 scripts/check_gguf_export.py merged.gguf --base BASE.gguf \\
        --wgrad target/release/wgrad --prompt-ids 1,2,3 --max-new-tokens 16

  - with --base: every metadata entry of the base is in the file with the
    same value, but general.file_type (the export's type) and
    general.quantization_version; the same tensors in the same order with
    the same shapes; matrices of the type the file type names (or F16, as
    llama.cpp's converter falls back for rows that are not whole blocks);
  - with --wgrad: `wgrad generate --model FILE --prompt-ids … --temperature 0
    --print-ids` against llama.cpp's greedy decode of the same ids (no BOS
    added by either), token by token; wgrad stops at an end-of-turn token,
    so its tokens must be llama.cpp's first ones. Prints the smallest gap
    between llama.cpp's best and second-best logit along the way.

    llama.cpp multiplies a quantized matrix by activations it rounds to
    8 bits too (Q8_0/Q8_K), which wgrad keeps in f32: the two may part at a
    near-tie. So the file's matrices are also de-quantized into an F32 copy
    (gguf-py), which llama.cpp runs in f32 arithmetic, the same function
    the file stores: there llama.cpp's greedy tokens must equal wgrad's on
    the quantized file, every one. On the quantized file itself they must
    be equal up to the first step whose gap is under --near-tie (default
    0.1), or all of them.

Exits 1 on the first difference.
"""

import argparse
import subprocess
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

FILE_TYPES = {0: Q.F32, 1: Q.F16, 2: Q.Q4_0, 3: Q.Q4_1, 7: Q.Q8_0}
OWN_KEYS = {"general.file_type", "general.quantization_version"}


def fields(reader):
    return {f.name: f for f in reader.fields.values() if not f.name.startswith("GGUF.")}


def check_against_base(path, base_path):
    file, base = gguf.GGUFReader(path), gguf.GGUFReader(base_path)
    got, want = fields(file), fields(base)
    for key, field in want.items():
        if key in OWN_KEYS:
            continue
        if key not in got:
            print(f"the base's `{key}` is missing")
            return False
        a = b"".join(p.tobytes() for p in field.parts)
        b = b"".join(p.tobytes() for p in got[key].parts)
        if a != b:
            print(f"`{key}` differs from the base's")
            return False
    extra = set(got) - set(want) - OWN_KEYS
    if extra:
        print(f"keys the base does not have: {sorted(extra)}")
        return False
    file_type = FILE_TYPES.get(int(got["general.file_type"].contents()))
    if file_type is None:
        print(f"general.file_type {got['general.file_type'].contents()} is not one wgrad writes")
        return False
    names = [(t.name, [int(d) for d in t.shape]) for t in file.tensors]
    if names != [(t.name, [int(d) for d in t.shape]) for t in base.tensors]:
        print("the tensors (names, order or shapes) differ from the base's")
        return False
    counts = {}
    for t, b in zip(file.tensors, base.tensors):
        if len(t.shape) == 2:
            ok = t.tensor_type == file_type or (t.tensor_type == Q.F16 and int(t.shape[0]) % 32 != 0)
        else:
            ok = t.tensor_type == b.tensor_type
        if not ok:
            print(f"{t.name} is {t.tensor_type.name} in a {file_type.name} file (the base's: {b.tensor_type.name})")
            return False
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        if not np.all(np.isfinite(values)):
            print(f"{t.name} decodes to non-finite values")
            return False
        counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
    print(f"{path}: the base's {len(want)} metadata entries and {len(names)} tensors, "
          f"file type {file_type.name} ({', '.join(f'{n} {k}' for k, n in counts.items())})")
    return True


def llama_cpp_greedy(path, prompt, new_tokens, threads):
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=max(64, len(prompt) + new_tokens), logits_all=True,
                verbose=False, n_threads=threads, n_batch=len(prompt) + new_tokens)
    llm.eval(prompt)
    tokens, gaps = [], []
    for _ in range(new_tokens):
        logits = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top = np.argsort(logits)[::-1][:2]
        gaps.append(logits[top[0]] - logits[top[1]])
        tokens.append(int(top[0]))
        llm.eval([int(top[0])])
    return tokens, gaps


def dequantized_copy(path, out):
    """`path` with every tensor stored as F32 values (gguf-py's decoding):
    the function the file stores, in llama.cpp's f32 arithmetic."""
    reader = gguf.GGUFReader(path)
    arch = fields(reader)["general.architecture"].contents()
    writer = gguf.GGUFWriter(out, arch)
    for key, field in fields(reader).items():
        if key in ("general.architecture", "general.alignment"):
            continue
        value = field.contents()
        if key == "general.file_type":
            value = 0
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        shape = [int(d) for d in reversed(t.shape)]
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        writer.add_tensor(t.name, values, raw_dtype=Q.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def wgrad_greedy(wgrad, path, prompt, new_tokens):
    cmd = [wgrad, "generate", "--model", path, "--prompt-ids", ",".join(map(str, prompt)),
           "--temperature", "0", "--max-new-tokens", str(new_tokens), "--print-ids"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{run.stderr}")
    for line in run.stdout.splitlines():
        if line.startswith("new_ids"):
            return [int(t) for t in line.split()[1:]]
    sys.exit(f"no new_ids line in wgrad's output:\n{run.stdout}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--base", help="the base GGUF file the export started from")
    parser.add_argument("--wgrad", help="the wgrad binary to compare greedy tokens with")
    parser.add_argument("--prompt-ids", default="1,2,3", help="comma-separated token ids")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--near-tie", type=float, default=0.1,
                        help="a gap under which llama.cpp's 8-bit activations may pick another token")
    args = parser.parse_args()
    if args.base and not check_against_base(args.file, args.base):
        return 1
    if not args.wgrad:
        return 0
    prompt = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
    ours = wgrad_greedy(args.wgrad, args.file, prompt, args.max_new_tokens)
    n = len(ours)
    print(f"wgrad                      {ours}")
    failed = False
    for label, path in [("llama.cpp", args.file), ("llama.cpp, de-quantized", None)]:
        if path is None:
            types = {t.tensor_type for t in gguf.GGUFReader(args.file).tensors}
            if types <= {Q.F32}:
                break
            path = args.file + ".f32-copy.gguf"
            dequantized_copy(args.file, path)
        theirs, gaps = llama_cpp_greedy(path, prompt, args.max_new_tokens, args.threads)
        print(f"{label + ' ' * (26 - len(label))} {theirs}")
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), n)
        print(f"  smallest gap between llama.cpp's two best logits: {min(gaps[: first + 1]):.4g}")
        if first == n:
            print(f"  {n} greedy tokens equal" + (" (wgrad stopped at an end-of-turn token)" if n < len(theirs) else ""))
        elif path == args.file and gaps[first] < args.near_tie:
            print(f"  equal up to position {first}, where llama.cpp's gap is {gaps[first]:.4g} "
                  f"(< {args.near_tie:g}: its 8-bit activations may pick either)")
        else:
            print(f"  the greedy tokens differ from position {first} (llama.cpp's gap there {gaps[first]:.4g})")
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
