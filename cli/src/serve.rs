//! `wgrad serve`: an OpenAI-compatible HTTP server (llama.cpp's
//! `llama-server`, vLLM and Ollama speak the same API), so any OpenAI
//! client works unchanged.
//!
//! One GPU worker thread owns the model: a [`Scheduler`] over a
//! [`Generator`] of `--max-batch` slots of `--max-context` positions each
//! (continuous batching, see `wgrad::infer::batch`). The HTTP side (axum on
//! tokio) checks and tokenizes each request, hands it to the worker over a
//! channel, and turns the tokens that come back into text: whole
//! responses, or server-sent events in OpenAI's chunk format. A client that
//! goes away cancels its request, which frees its slot at the worker's
//! next step.
//!
//! Routes: `POST /v1/chat/completions`, `POST /v1/completions`,
//! `GET /v1/models`, `GET /v1/models/{id}`, `GET /health` (no API key
//! needed: status, slots free, requests waiting). Errors are OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`. Besides OpenAI's
//! fields a request may give `top_k` and `ignore_eos` (as vLLM and
//! llama.cpp take them). `max_tokens` beyond the context's room is cut to
//! it (finish_reason `length`); a prompt that leaves no room is a 400.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::{Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use wgrad::infer::batch::{BatchRequest, Event, FinishReason, Scheduler};
use wgrad::infer::generate::{GeneratorOptions, PrefillMode, Sampling};
use wgrad::infer::pretrained::load_pretrained_with_config;
use wgrad::io::bpe::BpeTokenizer;
use wgrad::io::chat::{ChatMessage, ChatTemplate};
use wgrad::io::text::Utf8Stream;
use wgrad::{DeviceOptions, Kernels};

use wgrad::io::peft::PeftAdapter;
use wgrad::nn::{Lora, MultiLora, NamedAdapter};

use crate::generate::{bpe_generator, BoxedLm, DtypeName};

/// `wgrad serve`'s flags.
#[derive(clap::Args)]
pub struct ServeArgs {
    /// A GGUF file or a Hugging Face folder with a tokenizer.json.
    #[arg(long)]
    pub model: PathBuf,
    /// The address to listen on (loopback by default: put a proxy in
    /// front to serve other hosts).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// The port (0: any free one; the address is printed).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Requests decoded together: one KV-cache slot each.
    #[arg(long, default_value_t = 4)]
    pub max_batch: usize,
    /// Positions each slot holds, the prompt and the answer (default: the
    /// model's context, at most 4096).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Requests that may wait for a slot; more get 429 with Retry-After.
    #[arg(long, default_value_t = 64)]
    pub max_queue: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health
    /// (default: the WGRAD_API_KEY environment variable, if set).
    #[arg(long)]
    pub api_key: Option<String>,
    /// The model's id in the API (default: the file's or folder's name
    /// without `.gguf`).
    #[arg(long)]
    pub model_name: Option<String>,
    /// De-quantize a GGUF file's matrices and store them as this.
    #[arg(long, value_enum)]
    pub dtype: Option<DtypeName>,
    /// The largest request body, in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// A PEFT LoRA adapter folder served as the model NAME over --model
    /// (repeatable: every adapter over one copy of the base). A request's
    /// `model` picks an adapter or the base; requests with different
    /// adapters decode in the same batch.
    #[arg(long = "lora", value_name = "NAME=DIR")]
    pub lora: Vec<String>,
}

/// The default context's ceiling: a model's full context can be large
/// (SmolLM2's 8192 positions are 180 MiB of keys and values per slot).
const DEFAULT_MAX_CONTEXT: usize = 4096;
/// Seconds a refused client is told to wait.
const RETRY_AFTER_SECONDS: u64 = 1;
/// How long in-flight streams get after SIGINT/SIGTERM before the process
/// exits regardless.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// OpenAI's limit on stop sequences.
const MAX_STOPS: usize = 4;

/// What the worker thread is sent.
enum Job {
    Submit {
        request: BatchRequest,
        replies: UnboundedSender<Reply>,
    },
    Shutdown,
}

/// What the worker answers about a request: first whether it took it,
/// then (taken) its events.
enum Reply {
    Accepted,
    /// Refused before it was queued: the request's own fault (the
    /// scheduler's checks), so a 400 with this message.
    Refused(String),
    Event(Event),
}

/// What every handler shares.
struct Shared {
    model_id: String,
    /// The file name, also accepted as the model's name.
    model_file: String,
    /// The `--lora` adapters' names, in the generator's adapter order.
    adapters: Vec<String>,
    created: u64,
    api_key: Option<String>,
    tokenizer: BpeTokenizer,
    template: Option<ChatTemplate>,
    stops: Vec<u32>,
    context: usize,
    slots: usize,
    /// Slots plus the queue: requests admitted at once.
    capacity: usize,
    in_flight: AtomicUsize,
    /// The worker's view after its last step.
    free_slots: AtomicUsize,
    queued: AtomicUsize,
    /// The scheduler's decode steps and the request rows they ran.
    decode_steps: AtomicU64,
    decoded_rows: AtomicU64,
    jobs: std::sync::Mutex<mpsc::Sender<Job>>,
    shutting_down: AtomicBool,
    next_id: AtomicU64,
}

/// An OpenAI error response.
struct ApiError {
    status: StatusCode,
    message: String,
    kind: &'static str,
    param: Option<&'static str>,
    code: Option<&'static str>,
}

impl ApiError {
    fn invalid(message: impl Into<String>, param: Option<&'static str>, code: Option<&'static str>) -> Self {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param,
            code,
        }
    }

    fn body(&self) -> Value {
        json!({ "error": { "message": self.message, "type": self.kind, "param": self.param, "code": self.code } })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if matches!(
            self.status,
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE
        ) {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_SECONDS));
        }
        response
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// `wgrad serve`: loads the model, builds the generator, then serves until
/// SIGINT or SIGTERM.
pub fn serve(opts: &DeviceOptions, args: &ServeArgs) -> wgrad::Result<()> {
    let invalid = |reason: String| wgrad::Error::InvalidArgument { op: "serve", reason };
    if args.max_batch == 0 {
        return Err(invalid("--max-batch must be at least 1".into()));
    }
    let api_key = args
        .api_key
        .clone()
        .or_else(|| std::env::var("WGRAD_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let kernels = Arc::new(Kernels::new(wgrad::Device::open(opts)?));
    // Read once: it sizes the context here and the memory check in loading.
    let config = wgrad::io::lm_folder::read_model_config(&args.model)?;
    let model_context = config.lm_sizes().context;
    let context = args.max_context.unwrap_or(model_context.min(DEFAULT_MAX_CONTEXT));
    let options = GeneratorOptions {
        sequences: args.max_batch,
        context: Some(context),
        prefill: PrefillMode::OneSlot,
        ..GeneratorOptions::default()
    };
    let dtype = args.dtype.map(DtypeName::weights);
    let name = args
        .model
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let model_id = args
        .model_name
        .clone()
        .unwrap_or_else(|| name.strip_suffix(".gguf").unwrap_or(&name).to_string());
    let adapters = read_adapters(&args.lora, &[&model_id, &name])?;
    let mut lm = load_pretrained_with_config(&kernels, &args.model, config.as_ref(), dtype, &options)?;
    let adapter_names: Vec<String> = adapters.iter().map(|(name, _, _)| name.clone()).collect();
    lm.model = with_adapters(lm.model, adapters)?;
    let template = lm.tokenizer.chat_template().map(ChatTemplate::new).transpose()?;
    let generator = bpe_generator(kernels.clone(), &lm, args.dtype, &options)?;
    let (caches, staging) = generator.cache_bytes();
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "wgrad serve: {} on {}, loaded in {:.1} s; {} slots × {context} positions: KV caches {:.1} MiB (+{:.1} MiB staging for prefill), parameters {:.1} MiB",
        args.model.display(),
        kernels.device().label(),
        lm.load_seconds,
        args.max_batch,
        mib(caches),
        mib(staging),
        mib(generator.executor().parameter_arena().bytes())
    );
    let mut scheduler = Scheduler::new(generator)?;
    warm_up(&mut scheduler)?;
    let (jobs, receiver) = mpsc::channel();
    let shared = Arc::new(Shared {
        model_id,
        model_file: name,
        adapters: adapter_names,
        created: unix_now(),
        api_key,
        tokenizer: lm.tokenizer,
        template,
        stops: lm.stops,
        context,
        slots: args.max_batch,
        capacity: args.max_batch + args.max_queue,
        in_flight: AtomicUsize::new(0),
        free_slots: AtomicUsize::new(args.max_batch),
        queued: AtomicUsize::new(0),
        decode_steps: AtomicU64::new(0),
        decoded_rows: AtomicU64::new(0),
        jobs: std::sync::Mutex::new(jobs),
        shutting_down: AtomicBool::new(false),
        next_id: AtomicU64::new(1),
    });
    let worker_shared = shared.clone();
    let worker = std::thread::Builder::new()
        .name("wgrad-serve-gpu".into())
        .spawn(move || run_worker(scheduler, receiver, &worker_shared))
        .map_err(|e| invalid(format!("starting the GPU worker: {e}")))?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| invalid(format!("starting tokio: {e}")))?;
    let served = runtime.block_on(listen(shared.clone(), args));
    // The worker ends with the channel or the shutdown job.
    send_job(&shared, Job::Shutdown);
    let _ = worker.join();
    served
}

/// `--lora NAME=DIR`s, each folder read and checked as PEFT's (a bad one is
/// an error naming it), the names unique and none of the base's `taken`.
fn read_adapters(specs: &[String], taken: &[&str]) -> wgrad::Result<Vec<(String, PeftAdapter, PathBuf)>> {
    let invalid = |reason: String| wgrad::Error::InvalidArgument {
        op: "serve --lora",
        reason,
    };
    let mut adapters: Vec<(String, PeftAdapter, PathBuf)> = Vec::new();
    for spec in specs {
        let Some((name, dir)) = spec
            .split_once('=')
            .filter(|(n, d)| !n.trim().is_empty() && !d.is_empty())
        else {
            return Err(invalid(format!(
                "`{spec}` is not NAME=DIR (a model name and an adapter folder)"
            )));
        };
        let name = name.trim();
        if taken.contains(&name) {
            return Err(invalid(format!(
                "`{name}` is the base model's name: give the adapter another"
            )));
        }
        if adapters.iter().any(|(a, _, _)| a == name) {
            return Err(invalid(format!("two adapters are named `{name}`")));
        }
        let dir = PathBuf::from(dir);
        let peft = wgrad::io::peft::read(&dir).map_err(|e| invalid(format!("{name}={}: {e}", dir.display())))?;
        adapters.push((name.to_string(), peft, dir));
    }
    Ok(adapters)
}

/// `model` carrying `adapters` ([`MultiLora`]; `model` itself when there
/// are none), each fitted to its names and row order (a GGUF Llama's q and
/// k rows are permuted) and checked against it first, so an error names
/// its folder.
fn with_adapters(
    model: Box<dyn wgrad::nn::CausalLm>,
    adapters: Vec<(String, PeftAdapter, PathBuf)>,
) -> wgrad::Result<Box<dyn wgrad::nn::CausalLm>> {
    if adapters.is_empty() {
        return Ok(model);
    }
    let mut base = BoxedLm(model);
    let mut named = Vec::with_capacity(adapters.len());
    for (name, peft, dir) in adapters {
        let does_not_fit = |e: wgrad::Error| wgrad::Error::InvalidArgument {
            op: "serve --lora",
            reason: format!("{name}={} does not fit --model: {e}", dir.display()),
        };
        let fitted = peft.fitted_to(&base).map_err(does_not_fit)?;
        let checked =
            Lora::with_adapters(base, fitted.config.clone(), fitted.adapters.clone()).map_err(does_not_fit)?;
        base = checked.base;
        named.push(NamedAdapter::new(name, fitted.config, fitted.adapters));
    }
    Ok(Box::new(MultiLora::new(base, named)?))
}

/// Runs a request of one token through a prefill and a decode step, so
/// the kernels compile before the first client waits on them.
fn warm_up(scheduler: &mut Scheduler) -> wgrad::Result<()> {
    let bar = crate::common::spinner("compiling the decode kernels");
    let done = Arc::new(AtomicBool::new(false));
    let seen = done.clone();
    let sink = Box::new(move |event| {
        if matches!(event, Event::Done(_)) {
            seen.store(true, Ordering::Relaxed);
        }
        true
    });
    let result = scheduler
        .submit(BatchRequest::new(vec![0], 2, Sampling::greedy()), sink)
        .and_then(|()| {
            while !scheduler.is_idle() {
                scheduler.step()?;
            }
            Ok(())
        });
    bar.finish_and_clear();
    result
}

fn send_job(shared: &Shared, job: Job) -> bool {
    shared.jobs.lock().map(|jobs| jobs.send(job).is_ok()).unwrap_or(false)
}

/// Binds, prints the address, and serves until a signal.
async fn listen(shared: Arc<Shared>, args: &ServeArgs) -> wgrad::Result<()> {
    let invalid = |reason: String| wgrad::Error::InvalidArgument { op: "serve", reason };
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| invalid(format!("listening on {}:{}: {e}", args.host, args.port)))?;
    let address: SocketAddr = listener.local_addr().map_err(|e| invalid(e.to_string()))?;
    let key = if shared.api_key.is_some() {
        " (API key required)"
    } else {
        ""
    };
    // Tests and scripts read this line for the port.
    let adapters = if shared.adapters.is_empty() {
        String::new()
    } else {
        format!(" with adapters {}", shared.adapters.join(", "))
    };
    println!(
        "listening on http://{address} as model `{}`{adapters}{key}",
        shared.model_id
    );
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let app = router(shared.clone(), args.max_body_bytes);
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal(shared))
        .await
        .map_err(|e| invalid(format!("serving: {e}")))
}

fn router(shared: Arc<Shared>, max_body_bytes: usize) -> Router {
    let api = Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/models/{id}", get(model))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(shared.clone(), require_key));
    Router::new()
        .route("/health", get(health))
        .merge(api)
        .layer(middleware::from_fn(method_not_allowed))
        .layer(DefaultBodyLimit::max(max_body_bytes))
        .with_state(shared)
}

/// A route asked with a method it does not take: axum's 405 with OpenAI's
/// error body instead of an empty one (axum adds the `Allow` header to
/// it on the way out).
async fn method_not_allowed(request: Request, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_string());
    let response = next.run(request).await;
    if response.status() != StatusCode::METHOD_NOT_ALLOWED {
        return response;
    }
    let message = format!("{path} does not take {method}: the Allow header says what it takes");
    let (kind, code) = ("invalid_request_error", Some("method_not_allowed"));
    let error = ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        message,
        kind,
        param: None,
        code,
    };
    let (parts, _) = response.into_parts();
    let mut answer = error.into_response();
    for (name, value) in &parts.headers {
        if name != header::CONTENT_TYPE && name != header::CONTENT_LENGTH {
            answer.headers_mut().insert(name, value.clone());
        }
    }
    answer
}

/// Resolves at SIGINT or SIGTERM: no new requests, the worker ends every
/// request (streams get an error event), and a watchdog exits 0 after
/// [`SHUTDOWN_GRACE`] should a connection linger.
async fn shutdown_signal(shared: Arc<Shared>) {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {},
        _ = terminate => {},
    }
    eprintln!("wgrad serve: shutting down");
    shared.shutting_down.store(true, Ordering::SeqCst);
    send_job(&shared, Job::Shutdown);
    std::thread::spawn(|| {
        std::thread::sleep(SHUTDOWN_GRACE);
        eprintln!(
            "wgrad serve: connections still open after {} s; exiting",
            SHUTDOWN_GRACE.as_secs()
        );
        std::process::exit(0);
    });
}

/// The GPU worker: takes new requests between steps, steps while any
/// request runs or waits, and blocks for work when idle.
fn run_worker(mut scheduler: Scheduler, jobs: mpsc::Receiver<Job>, shared: &Shared) {
    loop {
        let first = if scheduler.is_idle() {
            match jobs.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            }
        } else {
            None
        };
        for job in first.into_iter().chain(std::iter::from_fn(|| jobs.try_recv().ok())) {
            match job {
                Job::Submit { request, replies } => {
                    let events = replies.clone();
                    // `submit` only queues: no event comes before the answer.
                    let sink = Box::new(move |event| events.send(Reply::Event(event)).is_ok());
                    let reply = match scheduler.submit(request, sink) {
                        Ok(()) => Reply::Accepted,
                        Err(e) => Reply::Refused(e.to_string()),
                    };
                    let _ = replies.send(reply);
                }
                Job::Shutdown => {
                    scheduler.end_all(FinishReason::Failed("the server is shutting down".into()));
                    return;
                }
            }
        }
        if let Err(e) = scheduler.step() {
            eprintln!("wgrad serve: the generator failed: {e}");
            scheduler.end_all(FinishReason::Failed(format!("the generator failed: {e}")));
        }
        shared.free_slots.store(scheduler.free_slots(), Ordering::Relaxed);
        shared.queued.store(scheduler.queued(), Ordering::Relaxed);
        let stats = scheduler.stats();
        shared.decode_steps.store(stats.decode_steps, Ordering::Relaxed);
        shared.decoded_rows.store(stats.decoded_rows, Ordering::Relaxed);
    }
}

async fn require_key(State(shared): State<Arc<Shared>>, headers: HeaderMap, request: Request, next: Next) -> Response {
    let Some(key) = &shared.api_key else {
        return next.run(request).await;
    };
    let given = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    match given {
        Some(given) if given.trim() == key => next.run(request).await,
        Some(_) => ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "Incorrect API key provided.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
        .into_response(),
        None => ApiError {
            status: StatusCode::UNAUTHORIZED,
            message: "You didn't provide an API key: give it as `Authorization: Bearer KEY`.".into(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
        .into_response(),
    }
}

async fn not_found(request: Request) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!("no route {} {}", request.method(), request.uri().path()),
        kind: "invalid_request_error",
        param: None,
        code: Some("not_found"),
    }
}

async fn health(State(shared): State<Arc<Shared>>) -> Response {
    let status = if shared.shutting_down.load(Ordering::Relaxed) {
        "shutting_down"
    } else {
        "ok"
    };
    let code = if status == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = json!({
        "status": status,
        "model": shared.model_id,
        "adapters": shared.adapters,
        "slots_total": shared.slots,
        "slots_free": shared.free_slots.load(Ordering::Relaxed),
        "queued": shared.queued.load(Ordering::Relaxed),
        "in_flight": shared.in_flight.load(Ordering::Relaxed),
        "context": shared.context,
        "decode_steps": shared.decode_steps.load(Ordering::Relaxed),
        "decoded_rows": shared.decoded_rows.load(Ordering::Relaxed),
    });
    (code, axum::Json(body)).into_response()
}

/// The model (None) or adapter's object, as OpenAI lists it; an adapter
/// names its base as `parent` (as vLLM's LoRA models do).
fn model_object(shared: &Shared, adapter: Option<usize>) -> Value {
    match adapter.and_then(|a| shared.adapters.get(a)) {
        None => json!({ "id": shared.model_id, "object": "model", "created": shared.created, "owned_by": "wgrad" }),
        Some(name) => {
            json!({ "id": name, "object": "model", "created": shared.created, "owned_by": "wgrad", "parent": shared.model_id })
        }
    }
}

async fn models(State(shared): State<Arc<Shared>>) -> Response {
    let data: Vec<Value> = std::iter::once(None)
        .chain((0..shared.adapters.len()).map(Some))
        .map(|a| model_object(&shared, a))
        .collect();
    axum::Json(json!({ "object": "list", "data": data })).into_response()
}

async fn model(State(shared): State<Arc<Shared>>, axum::extract::Path(id): axum::extract::Path<String>) -> Response {
    match check_model(&shared, Some(&id)) {
        Ok(adapter) => axum::Json(model_object(&shared, adapter)).into_response(),
        Err(e) => e.into_response(),
    }
}

/// The adapter a request's `model` names (None: the base, by its name,
/// its file's, or no name at all), or OpenAI's 404 for any other.
fn check_model(shared: &Shared, model: Option<&str>) -> Result<Option<usize>, ApiError> {
    match model {
        None => Ok(None),
        Some(m) if m == shared.model_id || m == shared.model_file => Ok(None),
        Some(m) => match shared.adapters.iter().position(|a| a == m) {
            Some(a) => Ok(Some(a)),
            None => {
                let served: Vec<String> = std::iter::once(&shared.model_id)
                    .chain(&shared.adapters)
                    .map(|n| format!("`{n}`"))
                    .collect();
                Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    message: format!(
                        "The model `{m}` does not exist; this server serves {}.",
                        served.join(", ")
                    ),
                    kind: "invalid_request_error",
                    param: Some("model"),
                    code: Some("model_not_found"),
                })
            }
        },
    }
}

/// `stop`: one string or several.
#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

/// The settings chat and text completions share.
#[derive(Deserialize)]
struct Settings {
    model: Option<String>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    max_tokens: Option<u64>,
    max_completion_tokens: Option<u64>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    seed: Option<u64>,
    stop: Option<Stop>,
    n: Option<u64>,
    #[serde(default)]
    ignore_eos: bool,
}

/// The roles OpenAI's chat messages take.
const ROLES: [&str; 6] = ["system", "developer", "user", "assistant", "tool", "function"];

/// The role a chat template gets for a message's `role`, None for one
/// OpenAI does not take: `developer` (OpenAI's newer name for the system
/// prompt) is `system`, which every template knows.
fn chat_role(role: &str) -> Option<&'static str> {
    match role {
        "developer" => Some("system"),
        other => ROLES.iter().find(|&&r| r == other).copied(),
    }
}

/// A message's content: text, or OpenAI's list of typed parts (text only).
#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

#[derive(Deserialize)]
struct ChatBody {
    messages: Vec<Message>,
    #[serde(flatten)]
    settings: Settings,
}

/// `prompt`: text, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

#[derive(Deserialize)]
struct CompletionBody {
    prompt: Prompt,
    #[serde(flatten)]
    settings: Settings,
}

/// The request body as `T`: malformed JSON, a missing `required` field and
/// a field of the wrong type are 400s naming what is wrong.
fn parse_body<T: serde::de::DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    required: &'static str,
) -> Result<T, ApiError> {
    let body = body.map_err(|e| ApiError {
        status: e.status(),
        message: format!("could not read the request body: {}", e.body_text()),
        kind: "invalid_request_error",
        param: None,
        code: None,
    })?;
    let value: Value = serde_json::from_slice(&body).map_err(|e| {
        ApiError::invalid(
            format!("We could not parse the JSON body of your request: {e}"),
            None,
            Some("invalid_json"),
        )
    })?;
    if !value.is_object() {
        return Err(ApiError::invalid(
            "the request body must be a JSON object",
            None,
            Some("invalid_json"),
        ));
    }
    if value.get(required).is_none_or(Value::is_null) {
        return Err(ApiError::invalid(
            format!("Missing required parameter: '{required}'."),
            Some(required),
            Some("missing_required_parameter"),
        ));
    }
    serde_json::from_value(value)
        .map_err(|e| ApiError::invalid(format!("Invalid request: {e}"), None, Some("invalid_value")))
}

/// What the HTTP side knows of a request it hands to the worker.
struct Prepared {
    id: String,
    /// The model the request names (the base's id, or an adapter's name)
    /// and the adapter it picks.
    model: String,
    adapter: Option<usize>,
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    stops: Vec<String>,
    ignore_eos: bool,
    stream: bool,
    include_usage: bool,
}

impl Shared {
    /// Checks the settings and the prompt's length against the context.
    fn prepare(
        &self,
        settings: &Settings,
        prompt: Vec<u32>,
        prompt_param: &'static str,
        id_prefix: &str,
    ) -> Result<Prepared, ApiError> {
        let adapter = check_model(self, settings.model.as_deref())?;
        if settings.n.is_some_and(|n| n != 1) {
            return Err(ApiError::invalid(
                "this server answers with one choice: n must be 1",
                Some("n"),
                Some("invalid_value"),
            ));
        }
        let temperature = settings.temperature.unwrap_or(1.0);
        if !(0.0..=2.0).contains(&temperature) {
            return Err(ApiError::invalid(
                format!("temperature {temperature} is outside [0, 2]"),
                Some("temperature"),
                Some("invalid_value"),
            ));
        }
        if let Some(p) = settings.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ApiError::invalid(
                    format!("top_p {p} is outside (0, 1]"),
                    Some("top_p"),
                    Some("invalid_value"),
                ));
            }
        }
        if settings.top_k == Some(0) {
            return Err(ApiError::invalid(
                "top_k must be at least 1",
                Some("top_k"),
                Some("invalid_value"),
            ));
        }
        let stops = match &settings.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(v)) => v.clone(),
        };
        if stops.len() > MAX_STOPS || stops.iter().any(String::is_empty) {
            return Err(ApiError::invalid(
                format!("stop takes at most {MAX_STOPS} non-empty strings"),
                Some("stop"),
                Some("invalid_value"),
            ));
        }
        if let Err(e) = wgrad::kernels::check_token_ids("serve", &prompt, self.tokenizer.vocab_size()) {
            return Err(ApiError::invalid(
                e.to_string(),
                Some(prompt_param),
                Some("invalid_value"),
            ));
        }
        let context = self.context;
        if prompt.len() >= context {
            return Err(ApiError::invalid(
                format!("This model's maximum context length is {context} tokens. However, your {prompt_param} resulted in {} tokens (and at least one must be left for the completion). Please reduce the length of the {prompt_param}.", prompt.len()),
                Some(prompt_param),
                Some("context_length_exceeded"),
            ));
        }
        let room = context - prompt.len();
        let max_tokens = match settings.max_completion_tokens.or(settings.max_tokens) {
            Some(0) => {
                return Err(ApiError::invalid(
                    "max_tokens must be at least 1",
                    Some("max_tokens"),
                    Some("invalid_value"),
                ))
            }
            Some(n) => usize::try_from(n).unwrap_or(usize::MAX).min(room),
            None => room,
        };
        let serial = self.next_id.fetch_add(1, Ordering::Relaxed);
        // Without a seed each request draws its own, as OpenAI's do.
        let seed = settings.seed.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
                ^ serial.rotate_left(32)
        });
        let sampling = Sampling {
            temperature,
            top_k: settings.top_k,
            top_p: settings.top_p,
            seed,
        };
        Ok(Prepared {
            id: format!("{id_prefix}-{serial}"),
            model: adapter.map_or(&self.model_id, |a| &self.adapters[a]).clone(),
            adapter,
            prompt,
            max_tokens,
            sampling,
            stops,
            ignore_eos: settings.ignore_eos,
            stream: settings.stream,
            include_usage: settings.stream_options.as_ref().is_some_and(|o| o.include_usage),
        })
    }

    /// Admits a request (429 when the slots and the queue are full, 503
    /// when shutting down) and hands it to the worker, waiting for its
    /// answer: a request the worker refuses is a 400, streamed or not.
    async fn start(self: &Arc<Self>, prepared: &Prepared) -> Result<Running, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the server is shutting down".into(),
                kind: "server_error",
                param: None,
                code: Some("shutting_down"),
            });
        }
        let admitted = self
            .in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < self.capacity).then_some(n + 1)
            })
            .is_ok();
        if !admitted {
            return Err(ApiError {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!(
                    "the server is busy: {} slots and {} waiting requests are taken; retry later",
                    self.slots,
                    self.capacity - self.slots
                ),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            });
        }
        let guard = Admission {
            shared: self.clone(),
            cancel: Arc::default(),
        };
        let stop_tokens = if prepared.ignore_eos {
            Vec::new()
        } else {
            self.stops.clone()
        };
        let request = BatchRequest {
            prompt: prepared.prompt.clone(),
            max_new_tokens: prepared.max_tokens,
            sampling: prepared.sampling,
            stop_tokens,
            cancel: guard.cancel.clone(),
            adapter: prepared.adapter,
        };
        let (replies, mut receiver) = unbounded_channel();
        let server_error = |status, message: &str| ApiError {
            status,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        };
        let stopped = || server_error(StatusCode::SERVICE_UNAVAILABLE, "the GPU worker has stopped");
        if !send_job(self, Job::Submit { request, replies }) {
            return Err(stopped());
        }
        match receiver.recv().await {
            Some(Reply::Accepted) => {}
            Some(Reply::Refused(message)) => {
                eprintln!("wgrad serve: {} refused: {message}", prepared.id);
                return Err(ApiError::invalid(message, None, Some("invalid_value")));
            }
            Some(Reply::Event(_)) => {
                let message = "the GPU worker sent an event before taking the request";
                return Err(server_error(StatusCode::INTERNAL_SERVER_ERROR, message));
            }
            None => return Err(stopped()),
        }
        Ok(Running {
            guard,
            events: receiver,
            text: Utf8Stream::default(),
            held: String::new(),
            stops: prepared.stops.clone(),
            completion_tokens: 0,
            stopped: false,
            unlogged: Some((format!("{} ({})", prepared.id, prepared.model), prepared.prompt.len())),
            started: Instant::now(),
            first_token: None,
        })
    }
}

/// A request counted in flight: uncounted, and cancelled (its slot freed
/// at the worker's next step, if it still runs), when dropped: when its
/// response is done or its client has gone.
struct Admission {
    shared: Arc<Shared>,
    cancel: Arc<AtomicBool>,
}

impl Drop for Admission {
    fn drop(&mut self) {
        self.cancel.store(true, Ordering::Relaxed);
        self.shared.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// How an answer ended, as the API says it.
enum Outcome {
    Finished(&'static str),
    Failed(String),
}

/// A request the worker runs: its events in, its text out.
struct Running {
    guard: Admission,
    /// The worker's replies after [`Reply::Accepted`]: events only.
    events: UnboundedReceiver<Reply>,
    text: Utf8Stream,
    /// Text that may begin a stop string, held back until it cannot.
    held: String,
    stops: Vec<String>,
    completion_tokens: usize,
    /// A stop string was seen: the tokens after it are not the answer's.
    stopped: bool,
    /// The request's id and prompt length, until its log line is written.
    unlogged: Option<(String, usize)>,
    started: Instant,
    first_token: Option<Instant>,
}

impl Running {
    /// The next text to send (possibly empty), or how the answer ended.
    async fn next(&mut self) -> Result<String, Outcome> {
        if self.stopped {
            return Err(Outcome::Finished("stop"));
        }
        match self.events.recv().await {
            Some(Reply::Event(Event::Token(token))) => {
                self.first_token.get_or_insert_with(Instant::now);
                self.completion_tokens += 1;
                let piece = self
                    .guard
                    .shared
                    .tokenizer
                    .decode_next(&mut self.text, token, true)
                    .map_err(|e| Outcome::Failed(e.to_string()))?;
                self.held.push_str(&piece);
                if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
                    // A stop string: the text before it, and the request
                    // ends at the worker's next step.
                    self.guard.cancel.store(true, Ordering::Relaxed);
                    self.stopped = true;
                    let before = self.held[..at].to_string();
                    self.held.clear();
                    // Bytes of a character the stop's last token began
                    // lie after the stop: not the answer's.
                    self.text = Utf8Stream::default();
                    return if before.is_empty() {
                        Err(Outcome::Finished("stop"))
                    } else {
                        Ok(before)
                    };
                }
                let keep = held_back(&self.held, &self.stops);
                let ready = self.held[..self.held.len() - keep].to_string();
                self.held.drain(..self.held.len() - keep);
                Ok(ready)
            }
            Some(Reply::Event(Event::Done(finished))) => Err(match finished.reason {
                FinishReason::Stop => Outcome::Finished("stop"),
                FinishReason::Length => Outcome::Finished("length"),
                FinishReason::Cancelled => Outcome::Finished("stop"),
                FinishReason::Failed(message) => Outcome::Failed(message),
            }),
            Some(Reply::Accepted | Reply::Refused(_)) => {
                Err(Outcome::Failed("the GPU worker answered a request twice".into()))
            }
            None => Err(Outcome::Failed("the GPU worker has stopped".into())),
        }
    }

    /// Text held back at the end (it began no stop string after all).
    fn rest(&mut self) -> String {
        let mut rest = std::mem::take(&mut self.held);
        rest.push_str(&self.text.finish());
        rest
    }

    fn usage(&self, prompt_tokens: usize) -> Value {
        json!({ "prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens, "total_tokens": prompt_tokens + self.completion_tokens })
    }

    /// The request's log line.
    fn log(&mut self, outcome: &str) {
        let Some((id, prompt_tokens)) = self.unlogged.take() else {
            return;
        };
        let elapsed = self.started.elapsed().as_secs_f64();
        let ttft = self.first_token.map_or(String::from("-"), |t| {
            format!("{:.0}", (t - self.started).as_secs_f64() * 1e3)
        });
        let decode = self.first_token.map_or(0.0, |t| t.elapsed().as_secs_f64());
        let rate = if self.completion_tokens > 1 && decode > 0.0 {
            format!("{:.1}", (self.completion_tokens - 1) as f64 / decode)
        } else {
            "-".into()
        };
        eprintln!("wgrad serve: {id} {outcome}: prompt_tokens={prompt_tokens} completion_tokens={} ttft_ms={ttft} tokens_per_s={rate} seconds={elapsed:.2}", self.completion_tokens);
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.log("cancelled: the client went away");
    }
}

/// Bytes at the end of `text` that begin one of `stops` (and so may end
/// up part of it), on a character boundary.
fn held_back(text: &str, stops: &[String]) -> usize {
    stops
        .iter()
        .flat_map(|stop| {
            (1..stop.len().min(text.len() + 1))
                .filter(move |&n| text.is_char_boundary(text.len() - n) && stop.starts_with(&text[text.len() - n..]))
        })
        .max()
        .unwrap_or(0)
}

fn error_value(message: &str) -> Value {
    json!({ "error": { "message": message, "type": "server_error", "param": null, "code": null } })
}

/// The two kinds of answer, chat and text completions, as their objects
/// name and shape them.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Text,
}

impl Kind {
    fn choice(self, text: &str, finish: Option<&str>) -> Value {
        match self {
            Kind::Chat => {
                json!({ "index": 0, "message": { "role": "assistant", "content": text }, "logprobs": null, "finish_reason": finish })
            }
            Kind::Text => json!({ "index": 0, "text": text, "logprobs": null, "finish_reason": finish }),
        }
    }

    fn delta(self, text: Option<&str>, finish: Option<&str>, first: bool) -> Value {
        match self {
            Kind::Chat => {
                let delta = match (text, first) {
                    (_, true) => json!({ "role": "assistant", "content": "" }),
                    (Some(t), _) => json!({ "content": t }),
                    (None, _) => json!({}),
                };
                json!({ "index": 0, "delta": delta, "logprobs": null, "finish_reason": finish })
            }
            Kind::Text => json!({ "index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish }),
        }
    }

    fn object(self, stream: bool) -> &'static str {
        match (self, stream) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Text, _) => "text_completion",
        }
    }
}

/// Runs a prepared request: a whole answer, or a stream of chunks.
async fn answer(shared: Arc<Shared>, prepared: Prepared, kind: Kind) -> Response {
    let mut running = match shared.start(&prepared).await {
        Ok(r) => r,
        Err(e) => return e.into_response(),
    };
    let prompt_tokens = prepared.prompt.len();
    let head = |stream: bool| json!({ "id": prepared.id, "object": kind.object(stream), "created": unix_now(), "model": prepared.model });
    if !prepared.stream {
        let mut text = String::new();
        let finish = loop {
            match running.next().await {
                Ok(piece) => text.push_str(&piece),
                Err(Outcome::Finished(reason)) => break reason,
                Err(Outcome::Failed(message)) => {
                    running.log("failed");
                    return ApiError {
                        status: StatusCode::INTERNAL_SERVER_ERROR,
                        message,
                        kind: "server_error",
                        param: None,
                        code: None,
                    }
                    .into_response();
                }
            }
        };
        text.push_str(&running.rest());
        running.log(finish);
        let mut body = head(false);
        body["choices"] = json!([kind.choice(&text, Some(finish))]);
        body["usage"] = running.usage(prompt_tokens);
        return axum::Json(body).into_response();
    }
    let state = StreamState {
        running,
        head: head(true),
        kind,
        prompt_tokens,
        include_usage: prepared.include_usage,
        done: false,
    };
    let first = (kind == Kind::Chat).then(|| state.chunk(json!([kind.delta(None, None, true)]), None));
    let events = futures::stream::iter(first.map(|c| Ok(SseEvent::default().data(c.to_string())))).chain(chunks(state));
    Sse::new(events).into_response()
}

/// A streamed answer's state.
struct StreamState {
    running: Running,
    /// Every chunk's id, object, created and model.
    head: Value,
    kind: Kind,
    prompt_tokens: usize,
    include_usage: bool,
    done: bool,
}

impl StreamState {
    fn chunk(&self, choices: Value, usage: Option<Value>) -> Value {
        let mut chunk = self.head.clone();
        chunk["choices"] = choices;
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        chunk
    }
}

/// The answer's chunks: one per piece of text, then the finish (with
/// `usage`; with `stream_options.include_usage` OpenAI's usage-only chunk
/// too) and `[DONE]`, or an error event.
fn chunks(state: StreamState) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    futures::stream::unfold(state, |mut state| async move {
        if state.done {
            return None;
        }
        let data = |v: &Value| SseEvent::default().data(v.to_string());
        let events = match state.running.next().await {
            Ok(piece) if piece.is_empty() => Vec::new(),
            Ok(piece) => vec![data(
                &state.chunk(json!([state.kind.delta(Some(&piece), None, false)]), None),
            )],
            Err(Outcome::Finished(finish)) => {
                state.done = true;
                let mut events = Vec::new();
                let rest = state.running.rest();
                if !rest.is_empty() {
                    events.push(data(
                        &state.chunk(json!([state.kind.delta(Some(&rest), None, false)]), None),
                    ));
                }
                let usage = state.running.usage(state.prompt_tokens);
                events.push(data(&state.chunk(
                    json!([state.kind.delta(None, Some(finish), false)]),
                    Some(usage.clone()),
                )));
                if state.include_usage {
                    events.push(data(&state.chunk(json!([]), Some(usage))));
                }
                events.push(SseEvent::default().data("[DONE]"));
                state.running.log(finish);
                events
            }
            Err(Outcome::Failed(message)) => {
                state.done = true;
                state.running.log("failed");
                vec![data(&error_value(&message))]
            }
        };
        Some((futures::stream::iter(events.into_iter().map(Ok)), state))
    })
    .flatten()
}

async fn chat_completions(State(shared): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    let prepared = parse_body::<ChatBody>(body, "messages").and_then(|body| {
        let template = shared.template.as_ref().ok_or_else(|| {
            ApiError::invalid(
                format!(
                    "the model `{}` has no chat template: use /v1/completions",
                    shared.model_id
                ),
                None,
                None,
            )
        })?;
        let mut messages = Vec::with_capacity(body.messages.len());
        for (i, m) in body.messages.into_iter().enumerate() {
            let role = chat_role(&m.role).ok_or_else(|| {
                let message = format!("messages[{i}].role is `{}`; the roles are {}", m.role, ROLES.join(", "));
                ApiError::invalid(message, Some("messages"), Some("invalid_value"))
            })?;
            let content = match m.content {
                None => String::new(),
                Some(Content::Text(t)) => t,
                Some(Content::Parts(parts)) => {
                    if let Some(other) = parts.iter().find(|p| p.kind != "text") {
                        return Err(ApiError::invalid(
                            format!("content parts of type `{}` are not supported: text only", other.kind),
                            Some("messages"),
                            Some("invalid_value"),
                        ));
                    }
                    parts.into_iter().filter_map(|p| p.text).collect()
                }
            };
            messages.push(ChatMessage::new(role, content));
        }
        if messages.is_empty() {
            return Err(ApiError::invalid(
                "messages must hold at least one message",
                Some("messages"),
                Some("invalid_value"),
            ));
        }
        let tokenizer = &shared.tokenizer;
        let rendered = template
            .render(
                &messages,
                true,
                &tokenizer.bos_token().unwrap_or_default(),
                &tokenizer.eos_token().unwrap_or_default(),
            )
            .map_err(|e| {
                ApiError::invalid(
                    format!("the chat template refused the messages: {e}"),
                    Some("messages"),
                    Some("invalid_value"),
                )
            })?;
        let prompt = tokenizer
            .encode(&rendered, false)
            .map_err(|e| ApiError::invalid(e.to_string(), Some("messages"), None))?;
        shared.prepare(&body.settings, prompt, "messages", "chatcmpl")
    });
    match prepared {
        Ok(prepared) => answer(shared, prepared, Kind::Chat).await,
        Err(e) => e.into_response(),
    }
}

async fn completions(State(shared): State<Arc<Shared>>, body: Result<Bytes, BytesRejection>) -> Response {
    let prepared = parse_body::<CompletionBody>(body, "prompt").and_then(|body| {
        let encode = |text: &str| {
            shared
                .tokenizer
                .encode(text, true)
                .map_err(|e| ApiError::invalid(e.to_string(), Some("prompt"), None))
        };
        let prompt = match &body.prompt {
            Prompt::Text(text) => encode(text)?,
            Prompt::Texts(texts) if texts.len() == 1 => encode(&texts[0])?,
            Prompt::Texts(_) => {
                return Err(ApiError::invalid(
                    "this server answers one prompt per request",
                    Some("prompt"),
                    Some("invalid_value"),
                ))
            }
            Prompt::Ids(ids) => ids.clone(),
        };
        shared.prepare(&body.settings, prompt, "prompt", "cmpl")
    });
    match prepared {
        Ok(prepared) => answer(shared, prepared, Kind::Text).await,
        Err(e) => e.into_response(),
    }
}
