// Gathered low-rank products: one Linear's LoRA adapters over a batch whose
// sequences each apply their own (S-LoRA's and Punica's shrink and expand),
// so requests with different adapters decode in one step.
//
// lora_shrink: h[rows, W]   = for each row, A_a · x[row] (its adapter's)
// lora_expand: out[rows, O] = y + scale_a · h[row, 0..r_a] · Bt_a
//   x      [rows, I]     the Linear's input rows (rows = S·T: sequence s
//                        owns rows s·T .. s·T + T)
//   y      [rows, O]     the Linear's output (its base product)
//   a      [R, I]        every adapter's A [r_a, I], stacked row-wise
//   bt     [R, O]        every adapter's Bᵀ [r_a, O], stacked the same way
//   h      [rows, W]     the shrink's result: W = the largest rank here
//   lora_meta [N, 3] f32 adapter a's (first stacked row, rank, scale); the
//                        first two whole numbers, the rank 0 where the
//                        adapter has none at this layer
//   index  [S] u32       each sequence's adapter; one ≥ N adds nothing
//                        (ops::NO_ADAPTER)
// h[row, j] is 0 for j ≥ its adapter's rank (and for a row without one), so
// the expand reads only h[row, 0..r_a]. The rank is cut to W and to the rows
// past the first (ops::LoraShape::segment): nothing reads out of bounds.

struct LoraParams {
    // S, rows, the columns of x (shrink) or y (expand), W, N, R.
    seqs: u32,
    rows: u32,
    cols: u32,
    width: u32,
    adapters: u32,
    ranks: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> params: LoraParams;
@group(0) @binding(1) var<storage, read> lora_meta: array<f32>;
@group(0) @binding(2) var<storage, read> index: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
// lora_shrink's operands.
@group(0) @binding(4) var<storage, read> x: array<f32>;
@group(0) @binding(5) var<storage, read> a: array<f32>;
// lora_expand's operands.
@group(0) @binding(6) var<storage, read> y: array<f32>;
@group(0) @binding(7) var<storage, read> h: array<f32>;
@group(0) @binding(8) var<storage, read> bt: array<f32>;

// The parameters through workgroup memory: lavapipe inlines uniform values
// that bound loops and re-optimizes the shader on every dispatch (see
// loss.wgsl); a value from workgroupUniformLoad is not.
var<workgroup> shared_params: LoraParams;

// Row `row`'s adapter as (first stacked row, rank, scale bits), rank 0 for
// a row without one.
fn lora_segment(q: LoraParams, row: u32) -> vec3<u32> {
    let adapter = index[row / (q.rows / q.seqs)];
    if adapter >= q.adapters {
        return vec3<u32>(0u, 0u, 0u);
    }
    let first = u32(max(lora_meta[adapter * 3u], 0.0));
    var rank = min(u32(max(lora_meta[adapter * 3u + 1u], 0.0)), q.width);
    rank = min(rank, select(0u, q.ranks - first, first < q.ranks));
    return vec3<u32>(first, rank, bitcast<u32>(lora_meta[adapter * 3u + 2u]));
}

// The shrink: a workgroup of LORA_WG lanes owns LORA_RANKS columns of one
// row of h; each lane sums its share of the I columns for every rank (x
// read once for all of them), and a fixed tree over the lanes adds the
// shares. Lanes are an override: 8 on a CPU adapter, 64 on a GPU.
override LORA_WG: u32 = 64u;
const LORA_RANKS: u32 = 8u;
// [LORA_RANKS][LORA_WG], LORA_WG ≤ 64.
var<workgroup> lora_partial: array<f32, 512>;
// The block's (first stacked row, ranks to sum, its row), uniform.
var<workgroup> lora_block: vec3<u32>;

@compute @workgroup_size(LORA_WG)
fn lora_shrink(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let lane = lid.x;
    if lane == 0u {
        shared_params = params;
    }
    let q = workgroupUniformLoad(&shared_params);
    // Workgroups (row, block of LORA_RANKS columns of h), blocks fastest.
    let blocks = max((q.width + LORA_RANKS - 1u) / LORA_RANKS, 1u);
    let group = wid.y * nwg.x + wid.x;
    let row = group / blocks;
    let j0 = (group % blocks) * LORA_RANKS;
    if lane == 0u {
        var block = vec3<u32>(0u, 0u, row);
        if row < q.rows {
            let segment = lora_segment(q, row);
            block = vec3<u32>(segment.x + j0, select(0u, min(segment.y - j0, LORA_RANKS), j0 < segment.y), row);
        }
        lora_block = block;
    }
    let block = workgroupUniformLoad(&lora_block);
    if row >= q.rows {
        return;
    }
    // A constant trip count over the block's ranks, so the loop unrolls
    // and acc stays in registers (indexed by a variable, llvmpipe keeps a
    // private array in memory).
    var acc: array<f32, LORA_RANKS>;
    for (var i = lane; i < q.cols; i += LORA_WG) {
        let xi = x[row * q.cols + i];
        for (var j = 0u; j < LORA_RANKS; j++) {
            if j < block.y {
                acc[j] += xi * a[(block.x + j) * q.cols + i];
            }
        }
    }
    for (var j = 0u; j < LORA_RANKS; j++) {
        lora_partial[j * LORA_WG + lane] = acc[j];
    }
    for (var stride = LORA_WG / 2u; stride > 0u; stride /= 2u) {
        workgroupBarrier();
        if lane < stride {
            for (var j = 0u; j < LORA_RANKS; j++) {
                lora_partial[j * LORA_WG + lane] += lora_partial[j * LORA_WG + lane + stride];
            }
        }
    }
    workgroupBarrier();
    if lane < LORA_RANKS && j0 + lane < q.width {
        out[row * q.width + j0 + lane] = lora_partial[lane * LORA_WG];
    }
}

// The expand: a workgroup of LORA_WG lanes owns LORA_COLS columns of one
// row (4 of every 4·LORA_WG per lane), so the row's adapter is read once and
// bounds a uniform loop over its ranks, and a CPU adapter's workgroup (one
// SIMD row of lanes) crosses its two barriers once per LORA_COLS columns,
// not per 8; a row without an adapter is y's, unchanged.
const LORA_COLS: u32 = 256u;
var<workgroup> lora_row: vec3<u32>;

@compute @workgroup_size(LORA_WG)
fn lora_expand(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let lane = lid.x;
    if lane == 0u {
        shared_params = params;
    }
    let q = workgroupUniformLoad(&shared_params);
    // Workgroups (row, tile of LORA_COLS columns), tiles fastest.
    let tiles = (q.cols + LORA_COLS - 1u) / LORA_COLS;
    let group = wid.y * nwg.x + wid.x;
    let row = group / tiles;
    let first_column = (group % tiles) * LORA_COLS;
    if lane == 0u {
        var segment = vec3<u32>(0u, 0u, 0u);
        if row < q.rows {
            segment = lora_segment(q, row);
        }
        lora_row = segment;
    }
    let segment = workgroupUniformLoad(&lora_row);
    if row >= q.rows {
        return;
    }
    let scale = bitcast<f32>(segment.z);
    let end = min(first_column + LORA_COLS, q.cols);
    // Each lane 4 neighbouring columns at a time, so each h[row, j] read
    // serves 4 (llvmpipe's loads, not its multiply-adds, cost the time);
    // each column's sum runs over the ranks in order.
    for (var c0 = first_column + lane * 4u; c0 < end; c0 += LORA_WG * 4u) {
        let last = end - 1u;
        let columns = vec4<u32>(c0, min(c0 + 1u, last), min(c0 + 2u, last), min(c0 + 3u, last));
        var sum = vec4<f32>(0.0);
        for (var j = 0u; j < segment.y; j++) {
            let at = (segment.x + j) * q.cols;
            let b = vec4<f32>(bt[at + columns.x], bt[at + columns.y], bt[at + columns.z], bt[at + columns.w]);
            sum += h[row * q.width + j] * b;
        }
        for (var u = 0u; u < 4u; u++) {
            let column = c0 + u;
            if column < end {
                let i = row * q.cols + column;
                var value = y[i];
                if segment.y > 0u {
                    value += scale * sum[u];
                }
                out[i] = value;
            }
        }
    }
}
