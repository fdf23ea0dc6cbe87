// Token sampling, one workgroup per row of logits:
//   sample_rows_forward: out[rows, 2] (u32) from logits[rows, vocab],
//     draws[rows, 3] = (u in [0, 1), temperature, top_p) and top_k[rows]
//     (u32).
//     out[r, 0] is the token, out[r, 1] the first column whose logit is not
//     finite (0xffffffff when all are; the token is then 0xffffffff too).
//
// A row's token, with k clamped to 1..=vocab:
// - temperature 0 (not > 0), or k = 1: the first maximum (lowest id among
//   equal maxima);
// - else the candidates are the k largest logits, ties at the boundary
//   broken by the lower id; w_i = exp((l_i − max) / temperature);
// - with top_p below 1 (nucleus sampling), only the smallest set of those
//   candidates, most likely first (equal logits by id, as top-k ranks
//   them), whose Σw reaches top_p times the candidates' Σw stays (at least
//   one: top_p ≤ 0 is greedy);
// - the token is the first candidate, walking them in id order, whose
//   running sum of w exceeds u · Σw (the last candidate if rounding leaves
//   no such one). cpu::sample_rows is the twin.
//
// Each of the WG lanes owns a contiguous chunk of the row, so "in id
// order" is lane order, then chunk order. No float atomics: reductions of
// u32 (keys, ids, counts) use workgroup atomics, which are exact, and the
// float sums are per-lane sums in id order joined by one lane in lane
// order, so a row's token is the same on every run.
//
// The k-th largest logit comes from a radix select over order-preserving
// u32 keys of the f32 values: four passes of 8-bit digits from the top,
// each a 256-bin histogram of the keys that match the digits chosen so far.
// A pass stops early when every key with the chosen digits is a candidate.
// The nucleus is again a threshold key with its first ties: a bisection
// over keys for the largest whose mass (Σw of the keys at or above it)
// reaches top_p · Σw, then as many ties at it as the mass still needs.

struct SampleParams {
    rows: u32,
    vocab: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read> draws: array<f32>;
@group(0) @binding(2) var<storage, read> top_k: array<u32>;
@group(0) @binding(3) var<uniform> params: SampleParams;
@group(0) @binding(4) var<storage, read_write> out: array<u32>;

// No token, no bad column.
const NONE: u32 = 0xffffffffu;
// Bins of one radix-select pass (8-bit digits).
const RADIX: u32 = 256u;

// The row's settings, read once by lane 0.
struct RowSetup {
    rows: u32,
    vocab: u32,
    u: f32,
    temperature: f32,
    top_p: f32,
    k: u32,
}

// Workgroup-wide results, written by lane 0 and read back uniformly.
struct WorkgroupResults {
    max_key: u32,
    first_max: u32,
    first_bad: u32,
    // Radix select: the digits chosen so far, how many of the keys having
    // them are still wanted, and how many keys have them.
    prefix: u32,
    wanted: u32,
    count: u32,
    // Σw over the candidates, the target u·Σw, the last candidate
    // (id + 1, 0 for none).
    total: f32,
    draw_target: f32,
    last_candidate: u32,
}

var<workgroup> setup: RowSetup;
var<workgroup> shared_state: WorkgroupResults;
var<workgroup> max_key: atomic<u32>;
var<workgroup> first_max: atomic<u32>;
var<workgroup> first_bad: atomic<u32>;
var<workgroup> last_candidate: atomic<u32>;
// Keys equal to the nucleus's threshold.
var<workgroup> nucleus_ties: atomic<u32>;
var<workgroup> histogram: array<atomic<u32>, 256>;
// Per lane, then (by lane 0) the exclusive prefix over lanes; entry WG
// holds the sum of all. 257 = WG + 1.
var<workgroup> lane_ties: array<u32, 257>;
var<workgroup> lane_sums: array<f32, 257>;

// A u32 whose order is the f32 order of finite values (−0 taken as +0, so
// that equal values have equal keys): flip every bit of a negative, set
// the sign bit of a positive.
fn order_key(v: f32) -> u32 {
    var bits = bitcast<u32>(v);
    if bits == 0x80000000u {
        bits = 0u;
    }
    if (bits & 0x80000000u) != 0u {
        return ~bits;
    }
    return bits | 0x80000000u;
}

fn key_value(key: u32) -> f32 {
    if (key & 0x80000000u) != 0u {
        return bitcast<f32>(key & 0x7fffffffu);
    }
    return bitcast<f32>(~key);
}

fn is_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) != 0x7f800000u;
}

// Through workgroup memory, as rowwise.wgsl's uniform_params: lavapipe
// inlines uniform values that bound loops and re-optimizes the shader on
// every dispatch; a value from workgroupUniformLoad is not inlined, and is
// uniform, so every branch on it keeps the barriers in uniform control
// flow. Also resets the workgroup atomics (workgroup memory is not
// zero-initialised).
fn load_setup(t: u32, row: u32) -> RowSetup {
    if t == 0u {
        let p = params;
        var s = RowSetup(p.rows, p.vocab, 0.0, 0.0, 1.0, 1u);
        if row < p.rows {
            s.u = draws[3u * row];
            s.temperature = draws[3u * row + 1u];
            s.top_p = draws[3u * row + 2u];
            s.k = top_k[row];
        }
        setup = s;
        atomicStore(&max_key, 0u);
        atomicStore(&first_max, NONE);
        atomicStore(&first_bad, NONE);
        atomicStore(&last_candidate, 0u);
        atomicStore(&nucleus_ties, 0u);
    }
    return workgroupUniformLoad(&setup);
}

// Whether the element with `key` is a candidate, given the threshold key
// and, when only some keys equal to it are candidates (`partial_ties`),
// how many such keys the lane has seen before it (`ties_seen`, advanced)
// against how many are wanted.
fn take(key: u32, threshold: u32, partial_ties: bool, ties_seen: ptr<function, u32>, wanted: u32) -> bool {
    if key != threshold || !partial_ties {
        return key >= threshold;
    }
    let taken = *ties_seen < wanted;
    *ties_seen += 1u;
    return taken;
}

// Keys equal to `threshold` in the lanes before lane t's chunk [lo, hi)
// of the row at `base`. All lanes call it (it holds barriers).
fn ties_before_lane(t: u32, lo: u32, hi: u32, base: u32, threshold: u32) -> u32 {
    var ties = 0u;
    for (var i = lo; i < hi; i++) {
        ties += u32(order_key(logits[base + i]) == threshold);
    }
    lane_ties[t] = ties;
    workgroupBarrier();
    if t == 0u {
        var running = 0u;
        for (var j = 0u; j < WG; j++) {
            let c = lane_ties[j];
            lane_ties[j] = running;
            running += c;
        }
    }
    workgroupBarrier();
    return lane_ties[t];
}

// The lanes' sums joined in lane order (so the same on every run), for
// every lane. All lanes call it (it holds barriers).
fn workgroup_sum(t: u32, lane_sum: f32) -> f32 {
    lane_sums[t] = lane_sum;
    workgroupBarrier();
    if t == 0u {
        var running = 0.0;
        for (var j = 0u; j < WG; j++) {
            running += lane_sums[j];
        }
        shared_state.total = running;
    }
    return workgroupUniformLoad(&shared_state).total;
}

// Σw over the lane's chunk of the keys at or above `from_key`.
fn lane_mass(lo: u32, hi: u32, base: u32, from_key: u32, top_value: f32, temperature: f32) -> f32 {
    var sum = 0.0;
    for (var i = lo; i < hi; i++) {
        let v = logits[base + i];
        if order_key(v) >= from_key {
            sum += exp((v - top_value) / temperature);
        }
    }
    return sum;
}

@compute @workgroup_size(256)
fn sample_rows_forward(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, @builtin(local_invocation_index) t: u32) {
    let row = wid.y * nwg.x + wid.x;
    let s = load_setup(t, row);
    if row >= s.rows {
        return;
    }
    let vocab = s.vocab;
    let base = row * vocab;
    let chunk = (vocab + WG - 1u) / WG;
    let lo = min(t * chunk, vocab);
    let hi = min(lo + chunk, vocab);

    // The lane's maximum (first id of it) and first non-finite logit.
    var best = 0u;
    var best_id = NONE;
    var bad = NONE;
    for (var i = lo; i < hi; i++) {
        let v = logits[base + i];
        if !is_finite(v) {
            bad = i;
            break;
        }
        let key = order_key(v);
        if best_id == NONE || key > best {
            best = key;
            best_id = i;
        }
    }
    atomicMin(&first_bad, bad);
    if best_id != NONE {
        atomicMax(&max_key, best);
    }
    workgroupBarrier();
    let top = atomicLoad(&max_key);
    if best_id != NONE && best == top {
        atomicMin(&first_max, best_id);
    }
    workgroupBarrier();
    if t == 0u {
        shared_state.max_key = top;
        shared_state.first_max = atomicLoad(&first_max);
        shared_state.first_bad = atomicLoad(&first_bad);
    }
    let found = workgroupUniformLoad(&shared_state);
    if found.first_bad != NONE || !(s.temperature > 0.0) || min(s.k, vocab) <= 1u {
        if t == 0u {
            out[2u * row] = select(found.first_max, NONE, found.first_bad != NONE);
            out[2u * row + 1u] = found.first_bad;
        }
        return;
    }
    let k = min(s.k, vocab);
    let top_value = key_value(found.max_key);

    // The candidates: keys ≥ threshold, except that with partial_ties only
    // the first `wanted` keys equal to the threshold (by id) are. All keys
    // are ≥ 0, so k = vocab needs no selection.
    var threshold = 0u;
    var partial_ties = false;
    var wanted = k;
    if k < vocab {
        var prefix = 0u;
        var mask = 0u;
        for (var digit_pass = 0u; digit_pass < 4u; digit_pass++) {
            let shift = 24u - 8u * digit_pass;
            // One bin per lane (RADIX = WG).
            atomicStore(&histogram[t], 0u);
            workgroupBarrier();
            for (var i = lo; i < hi; i++) {
                let key = order_key(logits[base + i]);
                if (key & mask) == prefix {
                    atomicAdd(&histogram[(key >> shift) & 0xffu], 1u);
                }
            }
            workgroupBarrier();
            // The digit of the wanted-th largest key among those with the
            // prefix, from the largest digit down.
            if t == 0u {
                var above = 0u;
                var digit = 0u;
                for (var j = 0u; j < RADIX; j++) {
                    digit = RADIX - 1u - j;
                    let c = atomicLoad(&histogram[digit]);
                    if above + c >= wanted {
                        shared_state.count = c;
                        break;
                    }
                    above += c;
                }
                shared_state.prefix = prefix | (digit << shift);
                shared_state.wanted = wanted - above;
            }
            let chosen = workgroupUniformLoad(&shared_state);
            prefix = chosen.prefix;
            wanted = chosen.wanted;
            mask |= 0xffu << shift;
            threshold = prefix;
            if chosen.count == wanted {
                // Every key with these digits is wanted: they and all
                // larger keys are the candidates.
                break;
            }
            // After the last digit the threshold is a whole key, and only
            // the first `wanted` of the keys equal to it are candidates.
            partial_ties = digit_pass == 3u;
        }
    }

    let temperature = s.temperature;
    // The nucleus (top_p < 1; NaN is none): the largest key whose mass
    // reaches top_p · Σw over the top-k candidates, and its first ties.
    if s.top_p < 1.0 {
        var seen = 0u;
        if partial_ties {
            seen = ties_before_lane(t, lo, hi, base, threshold);
        }
        var candidates_sum = 0.0;
        for (var i = lo; i < hi; i++) {
            let v = logits[base + i];
            if take(order_key(v), threshold, partial_ties, &seen, wanted) {
                candidates_sum += exp((v - top_value) / temperature);
            }
        }
        let mass_target = max(s.top_p, 0.0) * workgroup_sum(t, candidates_sum);
        // Invariant: the mass at `low` reaches mass_target (at the top-k
        // threshold it is all of Σw); above `high` it does not.
        var low = threshold;
        var high = found.max_key;
        while low < high {
            let mid = low + (high - low + 1u) / 2u;
            if workgroup_sum(t, lane_mass(lo, hi, base, mid, top_value, temperature)) >= mass_target {
                low = mid;
            } else {
                high = mid - 1u;
            }
        }
        // Finite values' keys stay below 0xff800000, so low + 1 does not wrap.
        var ties = 0u;
        for (var i = lo; i < hi; i++) {
            ties += u32(order_key(logits[base + i]) == low);
        }
        atomicAdd(&nucleus_ties, ties);
        let above = workgroup_sum(t, lane_mass(lo, hi, base, low + 1u, top_value, temperature));
        if t == 0u {
            // At the top-k threshold only its first `wanted` ties were candidates.
            var available = atomicLoad(&nucleus_ties);
            if low == threshold && partial_ties {
                available = wanted;
            }
            let tie_weight = exp((key_value(low) - top_value) / temperature);
            let needed = ceil((mass_target - above) / tie_weight);
            var count = available;
            if needed < f32(available) {
                count = max(u32(needed), 1u);
            }
            shared_state.wanted = count;
        }
        threshold = low;
        partial_ties = true;
        wanted = workgroupUniformLoad(&shared_state).wanted;
    }

    // Keys equal to the threshold before each lane's chunk.
    var ties_seen = 0u;
    if partial_ties {
        ties_seen = ties_before_lane(t, lo, hi, base, threshold);
    }
    let lane_ties_before = ties_seen;

    // Σw over the lane's candidates in id order, and its last candidate.
    var sum = 0.0;
    var last = 0u;
    for (var i = lo; i < hi; i++) {
        let v = logits[base + i];
        if take(order_key(v), threshold, partial_ties, &ties_seen, wanted) {
            sum += exp((v - top_value) / temperature);
            last = i + 1u;
        }
    }
    lane_sums[t] = sum;
    atomicMax(&last_candidate, last);
    workgroupBarrier();
    if t == 0u {
        var running = 0.0;
        for (var j = 0u; j < WG; j++) {
            let c = lane_sums[j];
            lane_sums[j] = running;
            running += c;
        }
        lane_sums[WG] = running;
        // A draw outside [0, 1) (NaN included) is clamped into it.
        let u = min(select(0.0, s.u, s.u > 0.0), 1.0);
        shared_state.total = running;
        shared_state.draw_target = u * running;
        shared_state.last_candidate = atomicLoad(&last_candidate);
    }
    let walk = workgroupUniformLoad(&shared_state);
    if !(walk.draw_target < walk.total) {
        // Past the end by rounding (or u = 1), or a sum that is not a
        // number (infinite weights): the last candidate, never no pick.
        if t == 0u {
            out[2u * row] = walk.last_candidate - 1u;
            out[2u * row + 1u] = NONE;
        }
        return;
    }
    // The one lane whose range of the running sum holds the target walks
    // its chunk again; rounding may leave its walk short of the target,
    // and then its last candidate is the one.
    if lane_sums[t] <= walk.draw_target && walk.draw_target < lane_sums[t + 1u] {
        var running = lane_sums[t];
        var token = last - 1u;
        ties_seen = lane_ties_before;
        for (var i = lo; i < hi; i++) {
            let v = logits[base + i];
            if take(order_key(v), threshold, partial_ties, &ties_seen, wanted) {
                running += exp((v - top_value) / temperature);
                if running > walk.draw_target {
                    token = i;
                    break;
                }
            }
        }
        out[2u * row] = token;
        out[2u * row + 1u] = NONE;
    }
}
