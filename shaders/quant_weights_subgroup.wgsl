// matvec_quant_forward_rows with A shared through subgroup broadcasts:
// decode's products over 1 to 16 rows (a bucket of them per pipeline) on an adapter with SUBGROUP and
// subgroups of exactly 8 invocations (the Rust side checks before this
// file is compiled). Not a module on its own: the registry appends it to
// the quant_weights family's source (quant_weights.wgsl and its shared
// files), whose overrides, bindings, epilogue and row-group helpers it
// uses, so quant_weights.wgsl itself stays core WGSL.
//
// Why: in matvec_quant_forward_rows every lane loads each row's whole
// block of A (8 vec4s), the same values as the other 7 lanes, and llvmpipe
// issues each storage load lane by lane, so loading A costs more than the
// multiply-adds it feeds. Here lane l loads vec4 l of each row's block and
// the others take it with subgroupBroadcast (a register shuffle on a CPU
// adapter): one vec4 load per lane and row instead of eight. The weights
// are each lane's own, as in the core kernel. Every lane runs the k loop
// (columns are clamped, not returned from), so each broadcast has all 8.

// A row's block of 32 values from each lane's vec4 `mine` (lane g holding
// values 4g..4g+3).
fn quant_broadcast_block(mine: vec4<f32>) -> array<vec4<f32>, 8> {
    return array<vec4<f32>, 8>(
        subgroupBroadcast(mine, 0u), subgroupBroadcast(mine, 1u), subgroupBroadcast(mine, 2u), subgroupBroadcast(mine, 3u),
        subgroupBroadcast(mine, 4u), subgroupBroadcast(mine, 5u), subgroupBroadcast(mine, 6u), subgroupBroadcast(mine, 7u),
    );
}

// quant_rows_a_group through broadcasts: block j of rows 4·group + 0..3 of
// A (rows past the bucket repeat the group's first, rows past the
// launch's `rows` its last row; neither is stored).
fn quant_rows_a_group_broadcast(group: u32, j: u32, k4: u32, rows: u32, lane: u32) -> QuantRowsA {
    let r0 = QUANT_ROW_GROUP * group;
    let ra = quant_rows_group_starts(r0, k4, rows) + vec4<u32>(8u * j + lane);
    let x0 = quant_broadcast_block(a4[ra.x]);
    var x1 = x0;
    var x2 = x0;
    var x3 = x0;
    if MATVEC_ROWS > r0 + 1u {
        x1 = quant_broadcast_block(a4[ra.y]);
    }
    if MATVEC_ROWS > r0 + 2u {
        x2 = quant_broadcast_block(a4[ra.z]);
    }
    if MATVEC_ROWS > r0 + 3u {
        x3 = quant_broadcast_block(a4[ra.w]);
    }
    return quant_rows_a_of(x0, x1, x2, x3);
}

@compute @workgroup_size(8, 1, 1)
fn matvec_quant_forward_rows_subgroup(
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(subgroup_invocation_id) sg_lane: u32,
) {
    let sizes = quant_rows_sizes(lid.x);
    let n = sizes.x;
    let kb = sizes.y / 32u;
    let k4 = sizes.y / 4u;
    let rows = sizes.z;
    let lane = quant_rows_lane(wid, nwg, sg_lane, n);
    var acc0 = QuantRowSums();
    var acc1 = QuantRowSums();
    var acc2 = QuantRowSums();
    var acc3 = QuantRowSums();
    for (var j = 0u; j < kb; j++) {
        let w = quant_columns8(lane.lo, lane.hi, j, kb);
        acc0 = quant_rows_group_fma(acc0, w, quant_rows_a_group_broadcast(0u, j, k4, rows, sg_lane), 0u);
        if MATVEC_ROWS > 4u {
            acc1 = quant_rows_group_fma(acc1, w, quant_rows_a_group_broadcast(1u, j, k4, rows, sg_lane), 4u);
        }
        if MATVEC_ROWS > 8u {
            acc2 = quant_rows_group_fma(acc2, w, quant_rows_a_group_broadcast(2u, j, k4, rows, sg_lane), 8u);
        }
        if MATVEC_ROWS > 12u {
            acc3 = quant_rows_group_fma(acc3, w, quant_rows_a_group_broadcast(3u, j, k4, rows, sg_lane), 12u);
        }
    }
    quant_rows_store_all(acc0, acc1, acc2, acc3, lane.col0, n, rows);
}
