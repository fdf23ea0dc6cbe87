//! `wgrad train`'s flags against the model and engine they would steer: a
//! flag given on the command line that does not apply is an error naming
//! why, never ignored. A flag left at its default is never refused.

use wgrad::parallel::engine::Strategy;

use crate::train::{ModelKind, OptimizerName, TrainArgs};

/// Why a flag does not apply to a run, or None where it does.
type Rule = fn(&Run) -> Option<String>;
/// A rule that may capture its reason.
type Check = Box<dyn Fn(&Run) -> Option<String>>;

/// What the rules look at: the run as the flags describe it.
struct Run<'a> {
    args: &'a TrainArgs,
    kind: ModelKind,
    strategy: Option<Strategy>,
}

fn mlp_only(why: &'static str) -> impl Fn(&Run) -> Option<String> {
    move |run| (run.kind != ModelKind::Mlp).then(|| format!("{why}; this run trains a language model"))
}

fn language_models_only(run: &Run) -> Option<String> {
    (run.kind == ModelKind::Mlp).then(|| {
        "it steers the language models (--model gpt, llama, qwen2, qwen3, mistral or gemma3), not the MLP".into()
    })
}

fn gpt_sizes(run: &Run) -> Option<String> {
    match run.kind {
        ModelKind::Mlp => language_models_only(run),
        ModelKind::Llama => {
            Some("it sets a GPT's sizes; a Llama's come from --preset (small, smollm2-135m or llama3.2-1b)".into())
        }
        ModelKind::Qwen2 | ModelKind::Qwen3 => Some(
            "it sets a GPT's sizes; a Qwen's come from --preset (small, qwen2.5-0.5b, qwen2.5-1.5b or qwen3-0.6b)"
                .into(),
        ),
        ModelKind::Mistral => {
            Some("it sets a GPT's sizes; a Mistral's come from --preset (small or mistral-7b-v0.1)".into())
        }
        ModelKind::Gemma3 => {
            Some("it sets a GPT's sizes; a Gemma 3's come from --preset (small or gemma3-270m)".into())
        }
        ModelKind::Gpt => None,
    }
}

fn pipeline_only(run: &Run) -> Option<String> {
    (run.strategy != Some(Strategy::Pipeline)).then(|| "it steers the pipeline engine: give --parallel pipeline".into())
}

/// `--micro-batches`: the pipeline's, which a dry run plans too.
fn micro_batches(run: &Run) -> Option<String> {
    pipeline_only(run).filter(|_| !run.args.dry_run)
}

fn data_parallel_only(run: &Run) -> Option<String> {
    let data = matches!(run.strategy, Some(Strategy::Data | Strategy::Zero(_))) || run.args.distributed.is_some();
    (!data).then(|| "it fixes data parallel's rows per device: give --parallel data or zero, or --distributed".into())
}

/// `--devices`: the devices an engine spreads over, or the most a dry
/// run plans for.
fn several_devices_only(run: &Run) -> Option<String> {
    let several = run.strategy.is_some() || run.args.distributed.is_some() || run.args.dry_run;
    (!several).then(|| "without --parallel one device trains: pick it with --adapter".into())
}

fn sgd_only(run: &Run) -> Option<String> {
    match run.args.optimizer {
        Some(OptimizerName::Sgd) => None,
        other => {
            let default = if run.kind == ModelKind::Mlp {
                OptimizerName::Adam
            } else {
                OptimizerName::Adamw
            };
            let name = other.unwrap_or(default);
            let name = format!("{name:?}").to_lowercase();
            Some(format!("it is SGD's; the optimizer is {name}: give --optimizer sgd"))
        }
    }
}

fn f16_only(run: &Run) -> Option<String> {
    (run.args.precision != "f16").then(|| "it paces f16's loss scaling: give --precision f16".into())
}

fn not_pretrained(run: &Run) -> Option<String> {
    match (language_models_only(run), &run.args.gpt.init, &run.args.gpt.lora) {
        (Some(why), ..) => Some(why),
        (None, Some(_), None) => Some(
            "it plans a model from its sizes, or adapters (--lora) over --init's model, not a full fine-tune of --init"
                .into(),
        ),
        (None, ..) => None,
    }
}

/// `--base-dtype`: the frozen base of an adapter run.
fn lora_base(run: &Run) -> Option<String> {
    if let Some(why) = language_models_only(run) {
        return Some(why);
    }
    if run.args.gpt.lora.is_none() {
        return Some("it stores the frozen base of an adapter run: give --lora".into());
    }
    crate::train_memory::base_storage(&run.args.gpt.base_dtype, None)
        .err()
        .map(|e| e.to_string())
}

/// `--lora`: adapters over a pretrained language model (or planned over
/// sized one by --dry-run), on every engine, as the library builds them.
fn lora(run: &Run) -> Option<String> {
    if let Some(why) = language_models_only(run) {
        return Some(why);
    }
    if run.args.gpt.init.is_none() && !run.args.dry_run {
        return Some("it trains adapters over a pretrained model: give --init FILE|DIR (or --dry-run to plan)".into());
    }
    crate::train::lora_config(&run.args.gpt).err().map(|e| e.to_string())
}

/// `--resume` over `--init`: only an adapter run keeps what it needs to
/// continue (a whole-model fine-tune saves no optimizer state).
fn resume(run: &Run) -> Option<String> {
    (run.args.gpt.init.is_some() && run.args.gpt.lora.is_none()).then(|| {
        "with --init it continues an adapter run (give the run's --lora); a whole-model fine-tune keeps no \
         optimizer state, so --init alone starts afresh"
            .into()
    })
}

/// Every flag that applies to some runs only, by clap's id, with its rule.
fn rules() -> Vec<(&'static str, Check)> {
    let rule = |r: Rule| -> Check { Box::new(r) };
    vec![
        (
            "epochs",
            Box::new(mlp_only(
                "it counts the MLP's passes over its data (a language model runs --max-steps)",
            )),
        ),
        ("hidden", Box::new(mlp_only("it sets the MLP's hidden widths"))),
        ("test_fraction", Box::new(mlp_only("it holds out the MLP's test split"))),
        (
            "checkpoint",
            Box::new(mlp_only(
                "it names the MLP's checkpoint (a language model writes --out)",
            )),
        ),
        (
            "mnist",
            Box::new(mlp_only("it is the MLP's data set (a language model reads --text)")),
        ),
        ("preset", rule(language_models_only)),
        ("n_layer", rule(gpt_sizes)),
        ("n_head", rule(gpt_sizes)),
        ("n_embd", rule(gpt_sizes)),
        ("block_size", rule(language_models_only)),
        ("tokenizer", rule(language_models_only)),
        ("text", rule(language_models_only)),
        ("warmup_steps", rule(language_models_only)),
        ("min_lr", rule(language_models_only)),
        ("weight_decay", rule(language_models_only)),
        ("clip", rule(language_models_only)),
        ("eval_every", rule(language_models_only)),
        ("eval_batches", rule(language_models_only)),
        ("out", rule(language_models_only)),
        ("sample_tokens", rule(language_models_only)),
        ("attention", rule(language_models_only)),
        ("checkpoint_activations", rule(language_models_only)),
        ("dry_run", rule(not_pretrained)),
        ("lora", rule(lora)),
        ("base_dtype", rule(lora_base)),
        ("resume", rule(resume)),
        ("momentum", rule(sgd_only)),
        ("micro_batches", rule(micro_batches)),
        ("schedule", rule(pipeline_only)),
        ("split", rule(data_parallel_only)),
        ("devices", rule(several_devices_only)),
        ("loss_scale_interval", rule(f16_only)),
    ]
}

/// Refuses the first flag given that does not apply to a run of `kind`
/// as the other flags describe it.
pub(crate) fn check(args: &TrainArgs, kind: ModelKind) -> wgrad::Result<()> {
    let strategy = args.parallel.as_deref().map(Strategy::parse).transpose()?;
    let run = Run { args, kind, strategy };
    for (id, rule) in rules() {
        if !args.given.iter().any(|g| g == id) {
            continue;
        }
        if let Some(why) = rule(&run) {
            let flag = format!("--{}", id.replace('_', "-"));
            return Err(wgrad::Error::InvalidArgument {
                op: "train",
                reason: format!("{flag} does not apply: {why}"),
            });
        }
    }
    Ok(())
}
