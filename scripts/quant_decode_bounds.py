#!/usr/bin/env python3
"""What bounds wgrad's quantized decode product on an adapter (issue 25):
the Q4_1 matrix-vector kernel a CPU adapter runs
(`matvec_quant_forward_columns`, one row of A, SmolLM2's shapes) timed
beside ablations of itself and beside the copy kernel, all in the same
minutes, so each ratio is to the copy kernel's bandwidth as
`wgrad bench`'s bandwidth_share is:

    kernel       the kernel as wgrad composes it (`wgrad shaders --dump`)
    no_weights   the same with its weight and scale loads replaced by a
                 hash of the block index: decode arithmetic and A's loads
    arithmetic   no memory loads at all (A from the index as well)
    loads_only   every load the kernel makes (weights, scales, A), the
                 same layout and lanes, XORed together: no arithmetic
    copy         `copy_vec4` over 64 MiB (bytes read plus written)

Each line gives microseconds per launch (the median of --rounds rounds
of --launches launches in one pass), the weights' GB/s and the ratio to
the copy kernel. The kernel's output is checked against numpy first.

    python -m venv /tmp/venv-wgpu && /tmp/venv-wgpu/bin/pip install wgpu numpy
    wgrad --backend vulkan shaders --dump /tmp/dump
    LP_NUM_THREADS=2 /tmp/venv-wgpu/bin/python scripts/quant_decode_bounds.py /tmp/dump
"""

import argparse
import itertools
import statistics
import struct
import time
from pathlib import Path

import numpy as np
import wgpu

ENTRY = "matvec_quant_forward_columns"
COLUMNS_PER_GROUP = 128  # QUANT_COLUMNS_PER_GROUP: 8 lanes × 16 columns
Q4_1 = 2  # QuantFormat::code

# Exact text of the dumped module that the ablations replace.
WEIGHT_LOAD = "    let w = qw4[p.q_base / 4u + block];\n    return array<vec4<f32>, 8>(\n        quant_word_ints(w.x, 0u, scaled)"
WEIGHT_HASH = "    let w = vec4<u32>(block * 2654435761u, block ^ 0x5a5a5a5au, block * 7u, block + 99u);\n    return array<vec4<f32>, 8>(\n        quant_word_ints(w.x, 0u, scaled)"
SCALE_LOAD = "fn quant_dm(block: u32) -> vec2<f32> {\n    return quant_unpack_f16x2(qs[p.s_base + block]);"
SCALE_HASH = "fn quant_dm(block: u32) -> vec2<f32> {\n    return vec2<f32>(f32(block & 7u), 0.5);"
A_LOAD = "fn quant_a_block(i: u32) -> array<vec4<f32>, 8> {\n    return array<vec4<f32>, 8>(a4[i], a4[i + 1u], a4[i + 2u], a4[i + 3u], a4[i + 4u], a4[i + 5u], a4[i + 6u], a4[i + 7u]);"
A_HASH = "fn quant_a_block(i: u32) -> array<vec4<f32>, 8> {\n    let f = f32(i);\n    return array<vec4<f32>, 8>(vec4(f), vec4(f + 1.0), vec4(f + 2.0), vec4(f + 3.0), vec4(f + 4.0), vec4(f + 5.0), vec4(f + 6.0), vec4(f + 7.0));"

# The kernel's loads and nothing else: lane l of a workgroup of 8 owns
# columns col0 + l + 8c (c < 16), and every step j loads A's block j (8
# vec4s) and each column's block j (a vec4 of nibbles and a scale word).
LOADS_ONLY = """
struct P { n: u32, k: u32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<storage, read> a4: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> qw4: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> qs: array<u32>;
@group(0) @binding(3) var<storage, read_write> c: array<u32>;
@group(0) @binding(4) var<uniform> p: P;
var<workgroup> sizes: vec2<u32>;

fn column(acc: u32, block: u32, ax: u32) -> u32 {
    let w = qw4[block];
    return acc ^ w.x ^ w.y ^ w.z ^ w.w ^ qs[block] ^ ax;
}

@compute @workgroup_size(8, 1, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    if lid.x == 0u { sizes = vec2<u32>(p.n, p.k); }
    let sz = workgroupUniformLoad(&sizes);
    let kb = sz.y / 32u;
    let col0 = wid.x * 128u + lid.x;
    let last = sz.x - 1u;
COLUMN_STARTS
ACCUMULATORS
    for (var j = 0u; j < kb; j++) {
        var ax = 0u;
        for (var g = 0u; g < 8u; g++) {
            let v = bitcast<vec4<u32>>(a4[8u * j + g]);
            ax ^= v.x ^ v.y ^ v.z ^ v.w;
        }
STEPS
    }
    c[wid.x * 8u + lid.x] = SUM;
}
"""

COPY = """
struct P { n: u32, k: u32, pad0: u32, pad1: u32 }
@group(0) @binding(0) var<storage, read> x4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> out4: array<vec4<f32>>;
@group(0) @binding(4) var<uniform> p: P;
var<workgroup> copy_len: u32;
@compute @workgroup_size(64)
fn copy_vec4(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let first = (wid.x * 64u + lid.x) * 4u;
    if lid.x == 0u { copy_len = p.n; }
    let n = workgroupUniformLoad(&copy_len);
    for (var j = 0u; j < 4u; j++) { let i = first + j; if i < n { out4[i] = x4[i]; } }
}
"""


def loads_only_source():
    cols = range(16)
    return (
        LOADS_ONLY.replace("COLUMN_STARTS", "\n".join(f"    let b{c} = min(col0 + {8 * c}u, last) * kb;" for c in cols))
        .replace("ACCUMULATORS", "\n".join(f"    var acc{c} = 0u;" for c in cols))
        .replace("STEPS", "\n".join(f"        acc{c} = column(acc{c}, b{c} + j, ax);" for c in cols))
        .replace("SUM", " ^ ".join(f"acc{c}" for c in cols))
    )


def ablate(source, pairs):
    for old, new in pairs:
        if old not in source:
            raise SystemExit(f"the dumped module no longer holds the text this ablation replaces:\n{old}")
        source = source.replace(old, new)
    return source


def q4_1_matrix(rng, n, k):
    """Random Q4_1 weights [n, k] as ops::pack_quantized lays them out
    (every block's 4 words of nibbles in ggml's order, then a word per
    block with f16 d low and f16 m high) and de-quantized for numpy."""
    kb = k // 32
    q = rng.integers(0, 16, size=(n, kb, 32)).astype(np.uint32)
    d = rng.uniform(0.001, 0.02, size=(n, kb)).astype(np.float16)
    m = rng.uniform(-0.1, 0.0, size=(n, kb)).astype(np.float16)
    weights = q.astype(np.float32) * d.astype(np.float32)[..., None] + m.astype(np.float32)[..., None]
    nibbles = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, kb, 4, 4)
    words = nibbles[..., 0] | (nibbles[..., 1] << 8) | (nibbles[..., 2] << 16) | (nibbles[..., 3] << 24)
    scales = d.view(np.uint16).astype(np.uint32) | (m.view(np.uint16).astype(np.uint32) << 16)
    return weights.reshape(n, k), words.reshape(-1), scales.reshape(-1)


class Harness:
    def __init__(self):
        adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        self.name = f"{adapter.info['device']} ({adapter.info['backend_type']})"
        self.device = adapter.request_device_sync(required_limits={"max_storage_buffer_binding_size": adapter.limits["max-storage-buffer-binding-size"], "max_buffer_size": adapter.limits["max-buffer-size"]})
        self.pipelines = {}

    def buffer(self, array, usage=wgpu.BufferUsage.STORAGE):
        return self.device.create_buffer_with_data(data=np.ascontiguousarray(array).tobytes(), usage=usage | wgpu.BufferUsage.COPY_SRC)

    def uniform(self, data):
        return self.buffer(np.frombuffer(data, np.uint8), wgpu.BufferUsage.UNIFORM)

    def bind_group(self, pipeline, bindings):
        # An entry point's automatic layout holds only the bindings it
        # uses: drop the unused ones (the ablations use fewer).
        layout = pipeline.get_bind_group_layout(0)
        optional = [b for b in (0, 1, 2, 5, 6) if b in bindings]
        for r in range(len(optional) + 1):
            for drop in itertools.combinations(optional, r):
                try:
                    return self.device.create_bind_group(layout=layout, entries=[{"binding": b, "resource": {"buffer": v}} for b, v in bindings.items() if b not in drop])
                except Exception:
                    pass
        raise SystemExit("no subset of the bindings fits the entry point's layout")

    def time(self, source, entry, constants, bindings, groups, launches, read=None):
        """Seconds per launch of `launches` launches in one pass, waited
        by reading 4 bytes (or all of `read`, returned)."""
        key = (source, entry, tuple(sorted(constants.items())))
        if key not in self.pipelines:
            module = self.device.create_shader_module(code=source)
            self.pipelines[key] = self.device.create_compute_pipeline(layout="auto", compute={"module": module, "entry_point": entry, "constants": constants})
        pipeline = self.pipelines[key]
        encoder = self.device.create_command_encoder()
        compute = encoder.begin_compute_pass()
        compute.set_pipeline(pipeline)
        compute.set_bind_group(0, self.bind_group(pipeline, bindings))
        for _ in range(launches):
            compute.dispatch_workgroups(groups, 1, 1)
        compute.end()
        start = time.perf_counter()
        self.device.queue.submit([encoder.finish()])
        out = self.device.queue.read_buffer(read) if read is not None else self.device.queue.read_buffer(bindings[3], 0, 4)
        return (time.perf_counter() - start) / launches, out


def quant_params(n, k):
    # QuantParams: m n k tiles_n tiles_total activation ldc bias_base
    # q_base s_base c_base _pad0, then part_end, part_q, part_s.
    return struct.pack("12I4I4I4I", 1, n, k, 0, 0, 0, n, 0, 0, 0, 0, 0, n, n, n, n, 0, 0, 0, 0, 0, 0, 0, 0)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dump", type=Path, help="the folder `wgrad shaders --dump` wrote")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--launches", type=int, default=20)
    args = parser.parse_args()
    kernel = (args.dump / "modules" / "quant_weights.wgsl").read_text()
    variants = {
        "kernel": kernel,
        "no_weights": ablate(kernel, [(WEIGHT_LOAD, WEIGHT_HASH), (SCALE_LOAD, SCALE_HASH)]),
        "arithmetic": ablate(kernel, [(WEIGHT_LOAD, WEIGHT_HASH), (SCALE_LOAD, SCALE_HASH), (A_LOAD, A_HASH)]),
    }
    loads_only = loads_only_source()
    h = Harness()
    rng = np.random.default_rng(0)
    # SmolLM2-135M's decode products: q, k and v (960 × 576), o (576 ×
    # 576), gate and up as one launch's worth of columns (3072 × 576), down
    # (576 × 1536).
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
    cases = {}
    for n, k in shapes:
        weights, words, scales = q4_1_matrix(rng, n, k)
        a = rng.standard_normal(k).astype(np.float32)
        spare = h.buffer(np.zeros(64, np.float32))
        cases[(n, k)] = {
            "expected": weights @ a,
            "bindings": {0: h.buffer(a), 1: h.buffer(words), 2: h.buffer(scales), 3: h.buffer(np.zeros(n, np.float32)), 4: h.uniform(quant_params(n, k)), 5: spare, 6: h.buffer(np.zeros(64, np.float32))},
            "loads": {0: h.buffer(a), 1: h.buffer(words), 2: h.buffer(scales), 3: h.buffer(np.zeros(n, np.uint32)), 4: h.uniform(struct.pack("4I", n, k, 0, 0))},
        }
    copy_floats = 16 << 20
    copy = {0: h.buffer(np.ones(copy_floats, np.float32)), 3: h.buffer(np.zeros(copy_floats, np.float32)), 4: h.uniform(struct.pack("4I", copy_floats // 4, 0, 0, 0))}
    constants = {"QUANT_FORMAT": Q4_1, "MATVEC_ROWS": 1}
    times = {}
    for n, k in shapes:
        case = cases[(n, k)]
        _, out = h.time(kernel, ENTRY, constants, case["bindings"], -(-n // COLUMNS_PER_GROUP), 1, read=case["bindings"][3])
        got = np.frombuffer(out, np.float32)
        worst = np.max(np.abs(got - case["expected"])) / np.max(np.abs(case["expected"]))
        if worst > 1e-4:
            raise SystemExit(f"the kernel disagrees with numpy at n={n} k={k}: relative error {worst:.2e}")
    for _ in range(args.rounds):
        t, _ = h.time(COPY, "copy_vec4", {}, copy, copy_floats // 4 // 256, 4)
        times.setdefault("copy", []).append(t)
        for n, k in shapes:
            case = cases[(n, k)]
            groups = -(-n // COLUMNS_PER_GROUP)
            for name, source in variants.items():
                t, _ = h.time(source, ENTRY, constants, case["bindings"], groups, args.launches)
                times.setdefault((name, n, k), []).append(t)
            t, _ = h.time(loads_only, "main", {}, case["loads"], groups, args.launches)
            times.setdefault(("loads_only", n, k), []).append(t)
    copy_gbps = 2 * 4 * copy_floats / statistics.median(times["copy"]) / 1e9
    print(f"adapter: {h.name}")
    print(f"copy kernel: {copy_gbps:.2f} GB/s (read plus written)")
    for n, k in shapes:
        weight_bytes = n * k // 32 * 20
        for name in ("kernel", "loads_only", "no_weights", "arithmetic"):
            t = statistics.median(times[(name, n, k)])
            gbps = weight_bytes / t / 1e9
            print(f"bench quant_decode_bound n={n} k={k} variant={name} us={t * 1e6:.1f} weight_gbps={gbps:.2f} copy_share={gbps / copy_gbps:.3f}")


if __name__ == "__main__":
    main()
