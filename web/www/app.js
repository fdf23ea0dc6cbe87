// The page: opens WebGPU through wgrad, trains make train's GPT with a live
// chart, and chats with a GGUF model. wgrad's calls that wait for the GPU
// return promises, so the page stays responsive between steps and tokens.
import init, { Gpu, GptTrainer, LmSession, installPanicHook } from './pkg/wgrad_web.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);

// What a browser without WebGPU is told.
const NO_WEBGPU = 'This browser offers no WebGPU (navigator.gpu is missing), which wgrad needs to run its kernels. ' +
  'Use a recent Chrome or Edge (113+), Safari 26 or Firefox 141+ on Windows; on Linux, Chrome needs ' +
  'chrome://flags/#enable-unsafe-webgpu. The page must be served from localhost or https.';

// The adapter as the browser describes it (wgpu passes on only its
// description, which browsers may leave empty) and the features it offers.
async function adapterInfo() {
  const adapter = await navigator.gpu.requestAdapter({ powerPreference: 'high-performance' });
  if (!adapter) return { name: '', features: [] };
  const i = adapter.info || {};
  return {
    name: [i.vendor, i.architecture, i.device, i.description].filter((s) => s).join(' '),
    features: [...adapter.features],
  };
}

// Opens the device wgrad uses: the adapter's limits, or WebGPU's defaults
// with ?webgpu-limits (what the test runs under).
export async function openGpu(webgpuLimits) {
  if (!navigator.gpu) throw new Error(NO_WEBGPU);
  await init();
  installPanicHook();
  let gpu;
  try {
    gpu = await Gpu.open(webgpuLimits);
  } catch (e) {
    throw new Error(`${e.message || e}\n${NO_WEBGPU}`);
  }
  const report = JSON.parse(gpu.report());
  const browser = await adapterInfo();
  report.name = report.adapter.startsWith('WebGPU adapter (') && browser.name ? browser.name : report.adapter;
  report.browser_features = browser.features;
  // wgpu 30's WebGPU backend does not request subgroups from the browser.
  if (!report.subgroups && browser.features.includes('subgroups')) {
    report.notes = report.notes.map((note) => note.startsWith('no subgroups')
      ? 'subgroups: the browser offers them, but wgpu 30 does not pass them on to wgrad yet, so the matrix ' +
        'products run their forms without subgroup operations'
      : note);
  }
  return { gpu, report };
}

function showGpu(report) {
  const feature = (on, name) => `${name} ${on ? 'yes' : 'no'}`;
  const sizes = report.subgroups ? ` (size ${report.subgroup_sizes.join('..')})` : '';
  $('gpu').innerHTML = '';
  const line = document.createElement('div');
  line.innerHTML = `<b>Adapter:</b> ${escapeHtml(report.name)} &middot; ${feature(report.shader_f16, 'shader-f16')} ` +
    `&middot; ${feature(report.subgroups, 'subgroups')}${sizes} &middot; ${report.storage_buffers} storage buffers ` +
    `per stage, ${report.binding_mib} MiB per binding`;
  $('gpu').append(line);
  for (const note of report.notes) {
    const n = document.createElement('div');
    n.className = 'muted';
    n.textContent = note;
    $('gpu').append(n);
  }
}

function escapeHtml(s) {
  return s.replace(/[&<>"]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;', '"': '&quot;' }[c]));
}

export async function fetchBytes(url) {
  const response = await fetch(url);
  if (!response.ok) throw new Error(`${url}: ${response.status} ${response.statusText}`);
  return new Uint8Array(await response.arrayBuffer());
}

// Lets the browser paint before a call that holds the main thread
// (building a model's kernels, loading a file).
const paint = () => new Promise((resolve) => setTimeout(resolve, 30));

// ---- training ----

const train = { trainer: null, running: false, losses: [], validation: [], times: [], clicked: 0, firstMs: null,
  // ?stop=N pauses once at step N (a demo, a screenshot).
  stopAt: Number(params.get('stop')) || Infinity };

function drawChart() {
  const canvas = $('chart');
  const g = canvas.getContext('2d');
  const [w, h] = [canvas.width, canvas.height];
  const pad = { l: 48, r: 12, t: 12, b: 28 };
  g.clearRect(0, 0, w, h);
  const last = train.trainer ? train.trainer.lastStep : 750;
  const all = train.losses.concat(train.validation).map((p) => p[1]);
  const top = all.length ? Math.ceil(Math.max(...all) * 2) / 2 : 4.5;
  const bottom = all.length ? Math.floor(Math.min(...all) * 2) / 2 : 1;
  const x = (step) => pad.l + (w - pad.l - pad.r) * (step / last);
  const y = (loss) => pad.t + (h - pad.t - pad.b) * ((top - loss) / Math.max(top - bottom, 1e-6));
  g.strokeStyle = '#d5dae4';
  g.fillStyle = '#5b6475';
  g.font = '12px system-ui';
  for (let v = bottom; v <= top + 1e-9; v += 0.5) {
    g.beginPath(); g.moveTo(pad.l, y(v)); g.lineTo(w - pad.r, y(v)); g.stroke();
    g.fillText(v.toFixed(1), 8, y(v) + 4);
  }
  for (let s = 0; s <= last; s += 125) {
    g.textAlign = s === 0 ? 'left' : s + 125 > last ? 'right' : 'center';
    g.fillText(String(s), x(s), h - 8);
  }
  g.textAlign = 'left';
  const line = (points, color, dots) => {
    g.strokeStyle = color; g.fillStyle = color; g.lineWidth = 1.5;
    g.beginPath();
    points.forEach(([s, l], i) => (i ? g.lineTo(x(s), y(l)) : g.moveTo(x(s), y(l))));
    g.stroke();
    if (dots) points.forEach(([s, l]) => { g.beginPath(); g.arc(x(s), y(l), 3, 0, 2 * Math.PI); g.fill(); });
  };
  line(train.losses, '#1d4ed8', false);
  line(train.validation, '#ea580c', true);
}

async function startTrainer(gpu) {
  const text = await fetchBytes('data/shakespeare.txt.gz');
  await paint();
  const trainer = new GptTrainer(gpu, text, Number($('seed').value) || 0);
  const run = JSON.parse(trainer.describe());
  $('run').textContent = `${run.model}: ${run.parameters.toLocaleString()} parameters; ${run.optimizer}; ` +
    `${run.data}; ${run.batch_size} windows (${run.tokens_per_step} tokens) per step, ${run.steps} steps; ${run.engine}`;
  $('seed').disabled = true;
  return trainer;
}

async function trainLoop(gpu) {
  const t = train;
  if (!t.trainer) t.trainer = await startTrainer(gpu);
  const trainer = t.trainer;
  while (t.running && trainer.steps < Math.min(t.stopAt, trainer.lastStep)) {
    const began = performance.now();
    const loss = await trainer.step();
    const step = trainer.steps;
    const now = performance.now();
    if (t.firstMs === null) {
      t.firstMs = now - t.clicked;
      $('first').textContent = `${(t.firstMs / 1000).toFixed(2)} s`;
    } else {
      // The first step, which compiles, stays out of the rate.
      t.times.push(now - began);
    }
    t.losses.push([step, loss]);
    $('step').textContent = `${step} / ${trainer.lastStep}`;
    $('loss').textContent = loss.toFixed(4);
    // Steps per second over the last 20 steps (validation and samples aside).
    const recent = t.times.slice(-20);
    if (recent.length) $('rate').textContent = (recent.length / (recent.reduce((a, b) => a + b) / 1000)).toFixed(2);
    const every = (id) => Math.max(1, Number($(id).value) || 1);
    const done = step === trainer.lastStep;
    if (step % every('eval-every') === 0 || done) {
      const v = await trainer.evaluate();
      t.validation.push([step, v]);
      $('val').textContent = `${v.toFixed(4)} (step ${step})`;
    }
    drawChart();
    if (step % every('sample-every') === 0 || done) {
      $('sample').textContent = '';
      $('sample-step').textContent = `after step ${step} (temperature 0.8, top-k 40)`;
      await trainer.sample(200, (piece) => { $('sample').textContent += piece; });
    }
  }
  if (trainer.steps >= trainer.lastStep) {
    $('start').textContent = 'Done';
    $('start').disabled = true;
  } else if (trainer.steps >= t.stopAt) {
    $('start').textContent = 'Start';
    t.stopAt = Infinity;
  }
  t.running = false;
}

function setupTraining(gpu) {
  drawChart();
  $('start').disabled = false;
  $('start').onclick = async () => {
    const t = train;
    if (t.running) {
      t.running = false;
      $('start').textContent = 'Start';
      return;
    }
    t.running = true;
    if (!t.clicked) t.clicked = performance.now();
    $('start').textContent = 'Pause';
    $('train-error').textContent = '';
    try {
      await trainLoop(gpu);
    } catch (e) {
      t.running = false;
      $('start').textContent = 'Start';
      $('train-error').textContent = String(e.message || e);
    }
  };
}

// ---- chat ----

const chat = { session: null, busy: false };

async function loadModel(gpu, bytes, name) {
  $('model').textContent = `loading ${name} (${(bytes.length / 1e6).toFixed(1)} MB)…`;
  $('send').disabled = true;
  await paint();
  chat.session = null;
  const session = new LmSession(gpu, bytes, name, 0);
  const m = JSON.parse(session.describe());
  $('model').textContent = `${m.name}: ${m.model}, ${m.weights} weights, vocabulary ${m.vocabulary}, context ` +
    `${m.context}${m.chat_template ? '' : ', no chat template (complete text only)'}; loaded in ` +
    `${m.load_seconds.toFixed(1)} s`;
  chat.session = session;
  $('send').disabled = false;
  $('transcript').textContent = '';
}

async function send() {
  const s = chat.session;
  const message = $('message').value;
  if (!s || chat.busy || !message.trim()) return;
  chat.busy = true;
  $('send').disabled = true;
  $('chat-error').textContent = '';
  const mode = document.querySelector('input[name=mode]:checked').value;
  const out = $('transcript');
  const you = document.createElement('span');
  you.className = 'you';
  you.textContent = mode === 'chat' ? `\n> ${message}\n` : `\n${message}`;
  out.append(you);
  const answer = document.createTextNode('');
  out.append(answer);
  const onToken = (piece) => { answer.textContent += piece; out.scrollTop = out.scrollHeight; };
  const args = [Number($('max-new').value) || 128, Number($('temperature').value) || 0,
    Number($('top-k').value) || 0, 1.0, 0, onToken];
  try {
    const r = JSON.parse(mode === 'chat' ? await s.chat(message, ...args) : await s.generate(message, ...args));
    $('speed').textContent = `prefill ${r.prefill_tokens} tokens in ${r.prefill_seconds.toFixed(2)} s; ` +
      `${r.decode_tokens_per_s.toFixed(1)} tokens/s decoding (${r.decode_tokens} tokens)`;
    $('message').value = '';
  } catch (e) {
    $('chat-error').textContent = String(e.message || e);
  }
  chat.busy = false;
  $('send').disabled = false;
}

async function setupChat(gpu) {
  const fail = (e) => { $('model').textContent = ''; $('chat-error').textContent = String(e.message || e); };
  $('file').onchange = async () => {
    const file = $('file').files[0];
    if (!file) return;
    try {
      await loadModel(gpu, new Uint8Array(await file.arrayBuffer()), file.name);
    } catch (e) { fail(e); }
  };
  // make web lists the GGUF files it serves in models/index.json.
  let served = [];
  try {
    served = await (await fetch('models/index.json')).json();
  } catch (e) { served = []; }
  if (!served.length) {
    $('served').disabled = true;
    $('served-name').textContent = '(no model served beside the page)';
  } else {
    $('served-name').textContent = served[0];
    $('served').onclick = async () => {
      try {
        $('model').textContent = `fetching ${served[0]}…`;
        await loadModel(gpu, await fetchBytes(`models/${served[0]}`), served[0]);
      } catch (e) { fail(e); }
    };
  }
  $('send').onclick = send;
  $('message').onkeydown = (e) => { if (e.key === 'Enter' && !e.shiftKey) { e.preventDefault(); send(); } };
  $('new-chat').onclick = () => { if (chat.session && !chat.busy) { chat.session.reset(null); $('transcript').textContent = ''; } };
}

function tabs() {
  for (const name of ['train', 'chat']) {
    $(`tab-${name}`).onclick = () => {
      for (const other of ['train', 'chat']) {
        $(`tab-${other}`).classList.toggle('on', other === name);
        $(other).classList.toggle('on', other === name);
      }
    };
  }
}

async function main() {
  tabs();
  if (params.has('selftest')) {
    const { selftest } = await import('./selftest.js');
    await selftest(params);
    return;
  }
  try {
    const { gpu, report } = await openGpu(params.has('webgpu-limits'));
    showGpu(report);
    setupTraining(gpu);
    await setupChat(gpu);
    // ?autostart starts training at once.
    if (params.has('autostart')) $('start').click();
  } catch (e) {
    $('gpu').className = 'bad';
    $('gpu').textContent = String(e.message || e);
  }
}

main();

export { GptTrainer, LmSession };
