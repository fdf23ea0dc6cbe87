#!/usr/bin/env python3
"""Writes the fixture of every GGUF block format wgrad decodes beyond the
first three (tests/suite/gguf.rs, tests/suite/quant_weights.rs), with the
`gguf` Python package (llama.cpp's own writer and de-quantizer), so the
Rust decoders are checked bit-exactly against code they did not come from.

  tests/fixtures/gguf-kquants.gguf
      one tensor per block format, its blocks random bytes (every bit
      pattern of a block is valid) with each f16 scale (d, and m or dmin)
      forced finite; types mixed per tensor as a `_M` file mixes them:
        Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL   [3, 64]  (rows, values)
        Q2_K, Q3_K, Q4_K, Q5_K, Q6_K          [2, 512]
      named `test.<type>` (lower case), plus `test.f32` [2, 3] and one
      IQ4_XS tensor `test.iq4_xs.unsupported` [1, 256] that wgrad reads as
      metadata but does not decode.
  tests/fixtures/gguf-kquants.safetensors
      each decodable tensor de-quantized by `gguf.quants.dequantize`, in
      row-major shape, as f32.

Needs only `pip install gguf numpy` (gguf 0.19.0 when written):
    python3 scripts/make_kquant_fixture.py
"""

import json
import pathlib

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

OUT = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
rng = np.random.default_rng(37)

# Byte offsets of each format's f16 scales within its block.
SCALES = {
    Q.Q8_0: [0], Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.IQ4_NL: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
SHAPES = {Q.Q2_K: (2, 512), Q.Q3_K: (2, 512), Q.Q4_K: (2, 512), Q.Q5_K: (2, 512), Q.Q6_K: (2, 512)}


def random_blocks(ty, n_blocks):
    """n_blocks random blocks of `ty`, each f16 scale finite: an all-ones
    exponent (inf or NaN) loses its top exponent bit."""
    _, type_size = gguf.GGML_QUANT_SIZES[ty]
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for at in SCALES.get(ty, []):
        hi = blocks[:, at + 1]
        blocks[:, at + 1] = np.where((hi & 0x7C) == 0x7C, hi & ~np.uint8(0x40), hi)
    return blocks


def safetensors(tensors):
    header, blobs, offset = {}, [], 0
    for name in sorted(tensors):
        data = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + b"".join(blobs)


def main():
    w = gguf.GGUFWriter(str(OUT / "gguf-kquants.gguf"), "kquants-test")
    expected = {}
    for ty in SCALES:
        rows, cols = SHAPES.get(ty, (3, 64))
        block_size, _ = gguf.GGML_QUANT_SIZES[ty]
        raw = random_blocks(ty, rows * cols // block_size).reshape(rows, -1)
        name = f"test.{ty.name.lower()}"
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=ty)
        values = gguf.quants.dequantize(raw, ty).astype(np.float32)
        assert values.shape == (rows, cols) and np.isfinite(values).all(), (ty, values.shape)
        expected[name] = values
    f = rng.standard_normal((2, 3)).astype(np.float32)
    w.add_tensor("test.f32", f)
    expected["test.f32"] = f
    iq4_xs = rng.integers(0, 256, size=(1, 136), dtype=np.uint8)
    w.add_tensor("test.iq4_xs.unsupported", iq4_xs, raw_shape=iq4_xs.shape, raw_dtype=Q.IQ4_XS)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (OUT / "gguf-kquants.safetensors").write_bytes(safetensors(expected))


if __name__ == "__main__":
    main()
