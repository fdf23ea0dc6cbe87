#!/usr/bin/env python3
"""Reads a GGUF file wgrad's writer (src/io/gguf_write.rs) wrote with gguf-py,
llama.cpp's own reader, and checks it bit for bit:

  - every metadata entry is the one EXPECTED.json lists ([[key, [type,
    value]], ...], arrays as ["array", element type, values]), in order: its bytes
    in the file equal the GGUF spec's encoding of that value (written here,
    apart from both readers), and gguf-py's decoded value equals it;
  - gguf-py finds every tensor at an aligned offset inside the file;
  - each tensor NAME stored as F16, Q8_0, Q4_0 or Q4_1 that has a
    companion `NAME.source` (F32) holds exactly the bytes gguf-py's
    `gguf.quants.quantize` makes of those f32 values: wgrad's quantizers are
    ggml's reference quantizers.

    python3 scripts/check_gguf_writer.py FILE.gguf EXPECTED.json

tests/suite/lora_export.rs writes both files and runs this where `gguf`
and `numpy` import. Exits 1 on the first difference.
"""

import json
import struct
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

SCALARS = {
    "u8": (V.UINT8, "<B"), "i8": (V.INT8, "<b"), "u16": (V.UINT16, "<H"), "i16": (V.INT16, "<h"),
    "u32": (V.UINT32, "<I"), "i32": (V.INT32, "<i"), "f32": (V.FLOAT32, "<f"), "bool": (V.BOOL, "<?"),
    "u64": (V.UINT64, "<Q"), "i64": (V.INT64, "<q"), "f64": (V.FLOAT64, "<d"),
}


def type_id(name):
    if name == "string":
        return V.STRING
    if name == "array":
        return V.ARRAY
    return SCALARS[name][0]


def encode_string(s):
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def encode(kind, value):
    """A value's bytes after its type id, per the GGUF spec."""
    if kind == "string":
        return encode_string(value)
    if kind in SCALARS:
        return struct.pack(SCALARS[kind][1], value)
    raise ValueError(kind)


def encode_array(element, values):
    out = struct.pack("<IQ", int(type_id(element)), len(values))
    for v in values:
        if element == "array":
            # Each element is ["array", its element type, its values].
            out += encode_array(v[1], v[2])
        else:
            out += encode(element, v)
    return out


def entry_bytes(key, typed):
    kind = typed[0]
    if kind == "array":
        body = encode_array(typed[1], typed[2])
    else:
        body = encode(kind, typed[1])
    return encode_string(key) + struct.pack("<I", int(type_id(kind))) + body


def same_value(kind, want, got):
    if kind == "f32":
        return np.float32(want) == np.float32(got)
    return want == got


def main():
    path, expected_path = sys.argv[1], sys.argv[2]
    expected = json.load(open(expected_path))
    reader = gguf.GGUFReader(path)
    fields = [f for f in reader.fields.values() if not f.name.startswith("GGUF.")]
    keys = [f.name for f in fields]
    if keys != [k for k, _ in expected]:
        print(f"metadata keys differ:\n  file     {keys}\n  expected {[k for k, _ in expected]}")
        return 1
    for field, (key, typed) in zip(fields, expected):
        raw = b"".join(p.tobytes() for p in field.parts)
        if raw != entry_bytes(key, typed):
            print(f"`{key}`: the file's bytes are not the spec's encoding of {typed}")
            return 1
        kind = typed[0]
        if kind == "array" and typed[1] != "array":
            got = field.contents()
            if len(got) != len(typed[2]) or not all(same_value(typed[1], w, g) for w, g in zip(typed[2], got)):
                print(f"`{key}`: gguf-py reads {got}, expected {typed[2]}")
                return 1
        elif kind != "array" and not same_value(kind, typed[1], field.contents()):
            print(f"`{key}`: gguf-py reads {field.contents()!r}, expected {typed[1]!r}")
            return 1
    print(f"{path}: {len(fields)} metadata entries equal the expected ones, byte for byte")

    size = reader.data.nbytes
    tensors = {t.name: t for t in reader.tensors}
    for t in reader.tensors:
        if t.data_offset % reader.alignment != 0 or t.data_offset + t.n_bytes > size:
            print(f"{t.name}: data at {t.data_offset} ({t.n_bytes} bytes) is not aligned to "
                  f"{reader.alignment} inside the file's {size} bytes")
            return 1
    checked = 0
    for name, t in tensors.items():
        source = tensors.get(name + ".source")
        if source is None:
            continue
        if source.tensor_type != Q.F32:
            print(f"{name}.source is {source.tensor_type.name}, not F32")
            return 1
        shape = tuple(int(d) for d in reversed(source.shape))
        values = np.asarray(source.data, dtype=np.float32).reshape(shape)
        want = np.asarray(gguf.quants.quantize(values, t.tensor_type)).tobytes()
        got = np.asarray(t.data).tobytes()
        if got != want:
            diff = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b) if len(got) == len(want) else None
            print(f"{name} ({t.tensor_type.name}): {len(got)} bytes differ from gguf-py's quantize "
                  f"({len(want)} bytes; first difference at byte {diff})")
            return 1
        checked += 1
    print(f"{checked} quantized tensors equal gguf-py's quantize of their f32 sources, bit for bit "
          f"(alignment {reader.alignment})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
