// The page checking itself (index.html?selftest): what the headless-Chromium
// test (cli/tests/web_chromium.rs) drives, and what a person can open to see
// that a browser runs wgrad. Under WebGPU's default limits it trains the
// GPT for `steps` steps (default 20) reading every loss, takes the
// validation loss and a `sample`-character sample (default 32), then with the GGUF file at `model` (when given) generates
// `tokens` greedy tokens (default 16) after "The capital of France is" and
// answers one chat turn. The report is shown on the page and POSTed to
// /report (the test's server; elsewhere the POST fails quietly).
import { openGpu, fetchBytes, GptTrainer, LmSession } from './app.js';

const say = (line) => {
  document.getElementById('gpu').textContent = line;
  fetch('progress', { method: 'POST', body: line }).catch(() => {});
};

async function training(gpu, params, report) {
  const steps = Number(params.get('steps') || 20);
  const started = performance.now();
  const text = await fetchBytes('data/shakespeare.txt.gz');
  const trainer = new GptTrainer(gpu, text, Number(params.get('seed') || 0));
  report.train = { run: JSON.parse(trainer.describe()), losses: [], step_ms: [] };
  report.train.build_ms = performance.now() - started;
  for (let i = 0; i < steps; i++) {
    const t = performance.now();
    report.train.losses.push(await trainer.step());
    report.train.step_ms.push(performance.now() - t);
    if (i === 0) report.train.first_step_ms = performance.now() - started;
  }
  // Steps per second after the first (which compiles what it first runs).
  const rest = report.train.step_ms.slice(1);
  report.train.steps_per_s = rest.length ? rest.length / (rest.reduce((a, b) => a + b, 0) / 1000) : null;
  say(`trained ${steps} steps: last loss ${report.train.losses[steps - 1]}`);
  const t = performance.now();
  report.train.validation = await trainer.evaluate();
  report.train.validation_ms = performance.now() - t;
  const s = performance.now();
  report.train.sample = await trainer.sample(Number(params.get('sample') || 32), null);
  report.train.sample_ms = performance.now() - s;
  trainer.free();
}

async function model(gpu, params, report) {
  const path = params.get('model');
  if (!path) return;
  const tokens = Number(params.get('tokens') || 16);
  let t = performance.now();
  const bytes = await fetchBytes(path);
  report.model = { fetch_ms: performance.now() - t, bytes: bytes.length };
  t = performance.now();
  const session = new LmSession(gpu, bytes, path.split('/').pop(), Number(params.get('context') || 0));
  report.model.load_ms = performance.now() - t;
  report.model.describe = JSON.parse(session.describe());
  say('model loaded');
  const prompt = params.get('prompt') || 'The capital of France is';
  report.generate = JSON.parse(await session.generate(prompt, tokens, 0, 0, 1, 0, null));
  say(`greedy: ${report.generate.text}`);
  const question = params.get('question') || 'What is the capital of France?';
  const pieces = [];
  report.chat = JSON.parse(await session.chat(question, Number(params.get('answer') || 48), 0, 0, 1, 0,
    (piece) => pieces.push(piece)));
  report.chat.streamed = pieces.join('');
  say(`chat: ${report.chat.text}`);
  session.free();
}

export async function selftest(params) {
  const report = { error: null };
  const started = performance.now();
  try {
    const { gpu, report: adapter } = await openGpu(true);
    report.adapter = adapter;
    say(`adapter: ${adapter.name}`);
    await training(gpu, params, report);
    await model(gpu, params, report);
  } catch (e) {
    report.error = `${e.message || e}\n${e.stack || ''}`;
  }
  report.ms = performance.now() - started;
  const body = JSON.stringify(report, null, 1);
  const pre = document.createElement('pre');
  pre.id = 'selftest';
  pre.textContent = body;
  document.body.append(pre);
  await fetch('report', { method: 'POST', body }).catch(() => {});
}
