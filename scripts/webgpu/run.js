// Replays `wgrad shaders --dump DIR`'s cases (cases.json, described in
// cli/src/webgpu_cases.rs) in this browser's WebGPU: every case's buffers,
// launches (pipelines with explicit layouts from each binding's `writable`
// flag), one compute pass, then each expected range read back and compared
// with the CPU twin's values within the case's tolerance. Dawn's validation
// errors (error scopes) and Tint's messages (getCompilationInfo) go into the
// report, which is POSTed to /report; each case's result also goes to
// /progress as it finishes, so a hang still shows how far the page got.
'use strict';

// Features wgrad can use when the adapter has them.
const WANTED_FEATURES = ['subgroups', 'shader-f16', 'timestamp-query'];
// A case that has not finished after this long is failed (a hung shader
// would otherwise stall every later case).
const CASE_TIMEOUT_MS = 30000;

const statusLine = document.getElementById('status');
const table = document.getElementById('results');

function show(text) {
  statusLine.textContent = text;
}

async function post(path, value) {
  try {
    await fetch(path, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(value) });
  } catch (e) {
    console.error(`POST ${path} failed: ${e}`);
  }
}

function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what} did not finish within ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

// Devices by the limits they were requested with: the default one (WebGPU's
// default limits, as wgrad's dump assumes) and one per raised set a case
// needs. A lost device is replaced on next use. An adapter makes one device,
// so each device after the first asks for a fresh adapter.
class Devices {
  constructor(adapter, features) {
    this.adapter = adapter;
    this.features = features;
    this.byKey = new Map();
    this.uncaptured = [];
  }

  async get(limits) {
    const key = JSON.stringify(limits);
    const held = this.byKey.get(key);
    if (held && !held.lost) return held;
    const adapter = this.adapter || (await navigator.gpu.requestAdapter());
    this.adapter = null;
    if (!adapter) throw new Error('navigator.gpu.requestAdapter() found no adapter for another device');
    const device = await adapter.requestDevice({ requiredFeatures: this.features, requiredLimits: limits });
    const entry = { device, lost: null, modules: new Map() };
    device.lost.then((info) => { entry.lost = `${info.reason}: ${info.message}`; });
    device.addEventListener('uncapturederror', (event) => { this.uncaptured.push(event.error.message); });
    this.byKey.set(key, entry);
    return entry;
  }
}

// A shader module per file and device, with Tint's messages.
async function moduleFor(entry, path) {
  let held = entry.modules.get(path);
  if (!held) {
    held = (async () => {
      const code = await (await fetch(path)).text();
      const module = entry.device.createShaderModule({ label: path, code });
      const info = await module.getCompilationInfo();
      const messages = info.messages.map((m) => `${path}:${m.lineNum}:${m.linePos} ${m.type}: ${m.message}`);
      const errors = info.messages.filter((m) => m.type === 'error').length;
      return { module, messages, errors };
    })();
    entry.modules.set(path, held);
  }
  return held;
}

// The GPU bytes an expected range covers.
function rangeBytes(e) {
  return e.dtype === 'f16' ? Math.ceil(e.count / 2) * 4 : e.count * 4;
}

function f16ToF32(bits) {
  const sign = bits & 0x8000 ? -1 : 1;
  const exp = (bits >> 10) & 0x1f;
  const frac = bits & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 31) return frac ? NaN : sign * Infinity;
  return sign * (1 + frac / 1024) * 2 ** (exp - 15);
}

// The values the GPU wrote, as numbers.
function gpuValues(e, bytes) {
  if (e.dtype === 'f32') return Array.from(new Float32Array(bytes, 0, e.count));
  if (e.dtype === 'u32') return Array.from(new Uint32Array(bytes, 0, e.count));
  const halves = new Uint16Array(bytes, 0, e.count);
  return Array.from(halves, f16ToF32);
}

function expectedValues(e, data) {
  const [at, len] = e.data;
  return e.dtype === 'u32' ? Array.from(new Uint32Array(data, at, len / 4)) : Array.from(new Float32Array(data, at, len / 4));
}

// |got − want| ≤ atol + rtol·|want| per element (or of the range's sum);
// a NaN where a number is wanted is an infinite error.
function compare(e, got, want) {
  const values = e.compare === 'sum' ? [got.reduce((s, v) => s + v, 0)] : got;
  let maxError = 0;
  let firstBad = null;
  for (let i = 0; i < want.length; i++) {
    const g = values[i];
    const w = want[i];
    let err = g === w ? 0 : Math.abs(g - w);
    if (Number.isNaN(err)) err = Number.isNaN(g) && Number.isNaN(w) ? 0 : Infinity;
    if (err > maxError) maxError = err;
    if (err > e.atol + e.rtol * Math.abs(w) && firstBad === null) firstBad = { index: i, got: g, want: w };
  }
  return { maxError, firstBad };
}

// Why a case cannot run on this adapter, or null.
function missingFor(c, adapter, info) {
  if (c.unbuilt) return `not built by wgrad on its adapter: ${c.unbuilt}`;
  const missing = c.features.filter((f) => !adapter.features.has(f));
  if (missing.length) return `missing feature ${missing.join(', ')}`;
  if (c.subgroup_size) {
    const [lo, hi] = [info.subgroupMinSize, info.subgroupMaxSize];
    if (lo !== c.subgroup_size || hi !== c.subgroup_size) {
      return `missing subgroup size ${c.subgroup_size}: needs subgroups of exactly ${c.subgroup_size} lanes, the adapter's have ${lo}..${hi}`;
    }
  }
  for (const [name, value] of Object.entries(c.limits)) {
    if (!(adapter.limits[name] >= value)) return `missing limit ${name} ${value}: the adapter offers ${adapter.limits[name]}`;
  }
  return null;
}

async function popErrors(device, count) {
  const messages = [];
  for (let i = 0; i < count; i++) {
    const error = await device.popErrorScope();
    if (error) messages.push(error.message);
  }
  return messages;
}

async function runCase(c, devices, adapter, info) {
  const result = { name: c.name, entries: c.entries, status: 'pass', reason: '', max_error: 0, validation: [], compilation: [], outputs: [], ms: 0 };
  const started = performance.now();
  const missing = missingFor(c, adapter, info);
  if (missing) {
    result.status = 'skip';
    result.reason = missing;
    return result;
  }
  const raised = Object.keys(c.limits).length ? ` (with ${Object.entries(c.limits).map(([k, v]) => `${k} ${v}`).join(', ')}, over WebGPU's defaults)` : '';
  const entry = await devices.get(c.limits);
  const device = entry.device;
  const data = await (await fetch(c.data)).arrayBuffer();
  const scopes = ['validation', 'internal', 'out-of-memory'];
  scopes.forEach((s) => device.pushErrorScope(s));
  const created = [];
  const buffers = c.buffers.map((b) => {
    const buffer = device.createBuffer({ size: b.size, usage: GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST, mappedAtCreation: true });
    new Uint8Array(buffer.getMappedRange()).set(new Uint8Array(data, b.data[0], b.data[1]));
    buffer.unmap();
    created.push(buffer);
    return buffer;
  });
  const steps = [];
  for (const launch of c.launches) {
    const module = await moduleFor(entry, launch.module);
    result.compilation.push(...module.messages.filter((m) => !result.compilation.includes(m)));
    if (module.errors) {
      result.status = 'fail';
      result.reason = `${launch.module} does not compile`;
      continue;
    }
    const visibility = GPUShaderStage.COMPUTE;
    const layoutEntries = launch.bindings.map((b) => ({ binding: b.slot, visibility, buffer: { type: b.writable ? 'storage' : 'read-only-storage' } }));
    layoutEntries.push({ binding: launch.params.slot, visibility, buffer: { type: 'uniform' } });
    const bindGroupLayout = device.createBindGroupLayout({ label: launch.entry, entries: layoutEntries });
    let pipeline;
    try {
      pipeline = await device.createComputePipelineAsync({
        label: launch.entry,
        layout: device.createPipelineLayout({ bindGroupLayouts: [bindGroupLayout] }),
        compute: { module: module.module, entryPoint: launch.entry, constants: launch.constants },
      });
    } catch (e) {
      result.status = 'fail';
      result.reason = `${launch.entry}: no pipeline`;
      result.validation.push(`createComputePipelineAsync(${launch.entry}): ${e.message}`);
      continue;
    }
    const [at, len] = launch.params.data;
    // Exactly wgrad's uniform block: a Rust struct smaller than the WGSL
    // one would be Dawn's error here, as it should be.
    const params = device.createBuffer({ size: Math.ceil(len / 4) * 4, usage: GPUBufferUsage.UNIFORM | GPUBufferUsage.COPY_DST, mappedAtCreation: true });
    new Uint8Array(params.getMappedRange()).set(new Uint8Array(data, at, len));
    params.unmap();
    created.push(params);
    const entries = launch.bindings.map((b) => ({ binding: b.slot, resource: { buffer: buffers[b.buffer], offset: b.offset, size: b.size } }));
    entries.push({ binding: launch.params.slot, resource: { buffer: params } });
    const bindGroup = device.createBindGroup({ label: launch.entry, layout: bindGroupLayout, entries });
    steps.push({ pipeline, bindGroup, workgroups: launch.workgroups });
  }
  const encoder = device.createCommandEncoder({ label: c.name });
  const pass = encoder.beginComputePass({ label: c.name });
  for (const s of steps) {
    pass.setPipeline(s.pipeline);
    pass.setBindGroup(0, s.bindGroup);
    pass.dispatchWorkgroups(...s.workgroups);
  }
  pass.end();
  const staging = c.expected.map((e) => {
    const size = rangeBytes(e);
    const buffer = device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
    encoder.copyBufferToBuffer(buffers[e.buffer], e.offset, buffer, 0, size);
    created.push(buffer);
    return buffer;
  });
  device.queue.submit([encoder.finish()]);
  result.validation.push(...(await popErrors(device, scopes.length)));
  if (result.status === 'pass' && result.validation.length) {
    result.status = 'fail';
    result.reason = 'WebGPU errors';
  }
  if (result.status === 'pass') {
    for (let i = 0; i < c.expected.length; i++) {
      const e = c.expected[i];
      await staging[i].mapAsync(GPUMapMode.READ);
      const got = gpuValues(e, staging[i].getMappedRange().slice(0));
      staging[i].unmap();
      const { maxError, firstBad } = compare(e, got, expectedValues(e, data));
      result.outputs.push({ name: e.name, max_error: maxError, pass: !firstBad, first_bad: firstBad });
      result.max_error = Math.max(result.max_error, maxError);
      if (firstBad && result.status === 'pass') {
        result.status = 'fail';
        result.reason = `${e.name}[${firstBad.index}] = ${firstBad.got}, the twin says ${firstBad.want} (atol ${e.atol}, rtol ${e.rtol})`;
      }
    }
  }
  if (entry.lost) {
    result.status = 'fail';
    result.reason = `device lost: ${entry.lost}`;
  }
  if (result.status === 'pass' && raised) result.reason = `ran${raised}`;
  created.forEach((b) => b.destroy());
  result.ms = Math.round(performance.now() - started);
  return result;
}

function addRow(r) {
  const row = table.insertRow();
  row.className = r.status;
  for (const text of [r.status, r.name, r.max_error.toExponential(2), `${r.ms} ms`, r.reason]) row.insertCell().textContent = text;
}

async function main() {
  const report = { user_agent: navigator.userAgent, adapter: null, features: [], cases: [], error: null, uncaptured: [], ms: 0 };
  const started = performance.now();
  try {
    if (!navigator.gpu) throw new Error('navigator.gpu is missing: WebGPU is not enabled in this browser');
    const adapter = await navigator.gpu.requestAdapter();
    if (!adapter) throw new Error('navigator.gpu.requestAdapter() found no adapter');
    const info = adapter.info || {};
    report.adapter = {
      vendor: info.vendor, architecture: info.architecture, device: info.device, description: info.description,
      subgroup_min_size: info.subgroupMinSize, subgroup_max_size: info.subgroupMaxSize,
      features: [...adapter.features].sort(),
      max_storage_buffers_per_shader_stage: adapter.limits.maxStorageBuffersPerShaderStage,
    };
    const features = WANTED_FEATURES.filter((f) => adapter.features.has(f));
    report.features = features;
    const devices = new Devices(adapter, features);
    const manifest = await (await fetch('cases.json')).json();
    report.built_on = manifest.built_on;
    for (const [i, c] of manifest.cases.entries()) {
      show(`case ${i + 1} of ${manifest.cases.length}: ${c.name}`);
      let r;
      try {
        r = await withTimeout(runCase(c, devices, adapter, info), CASE_TIMEOUT_MS, c.name);
      } catch (e) {
        r = { name: c.name, entries: c.entries, status: 'fail', reason: `exception: ${e.message}`, max_error: 0, validation: [], compilation: [], outputs: [], ms: 0 };
        // A hung or broken device is not reused.
        for (const held of devices.byKey.values()) held.lost = held.lost || 'replaced after an exception';
      }
      report.cases.push(r);
      addRow(r);
      await post('/progress', r);
    }
    report.uncaptured = devices.uncaptured;
  } catch (e) {
    report.error = String(e && e.stack ? e.stack : e);
  }
  report.ms = Math.round(performance.now() - started);
  const failed = report.cases.filter((r) => r.status === 'fail').length;
  show(report.error ? `error: ${report.error}` : `done: ${report.cases.length} cases, ${failed} failed, ${report.ms} ms`);
  await post('/report', report);
}

main();
