//! `wgrad train --model gpt`: a GPT on text, with a progress bar, the
//! validation loss, both curves in the PNG, the model folder and a sample.

use std::path::PathBuf;

use clap::ValueEnum;
use indicatif::{ProgressBar, ProgressStyle};
use wgrad::lm_training::{LmProgress, LmRunInfo, LmTrainConfig, LmTrainingRun, TextSource, TokenizerKind};
use wgrad::DeviceOptions;

use crate::{plot, spinner, TrainArgs};

#[derive(Clone, Copy, Debug, ValueEnum)]
pub enum TokenizerName {
    /// One token per character of the training text.
    Char,
    /// GPT-2's byte-level BPE (r50k_base, 50,257 tokens).
    Gpt2,
}

/// The GPT's flags; the defaults are `make train`'s run ([`LmTrainConfig`]).
#[derive(clap::Args)]
pub struct GptArgs {
    /// GPT: transformer blocks.
    #[arg(long, default_value_t = LmTrainConfig::default().n_layer)]
    n_layer: usize,
    /// GPT: attention heads per block.
    #[arg(long, default_value_t = LmTrainConfig::default().n_head)]
    n_head: usize,
    /// GPT: channels.
    #[arg(long, default_value_t = LmTrainConfig::default().n_embd)]
    n_embd: usize,
    /// GPT: context length in tokens.
    #[arg(long, default_value_t = LmTrainConfig::default().block_size)]
    block_size: usize,
    /// GPT: the tokenizer.
    #[arg(long, value_enum, default_value_t = TokenizerName::Char)]
    tokenizer: TokenizerName,
    /// GPT: train on this UTF-8 text file instead of the shipped Shakespeare.
    #[arg(long)]
    text: Option<PathBuf>,
    /// GPT: steps of linear warmup before the cosine decay.
    #[arg(long, default_value_t = LmTrainConfig::default().warmup_steps)]
    warmup_steps: u64,
    /// GPT: the learning rate the cosine decays to at the last step.
    #[arg(long, default_value_t = LmTrainConfig::default().min_lr)]
    min_lr: f32,
    /// GPT: AdamW's weight decay (matrices only).
    #[arg(long, default_value_t = LmTrainConfig::default().weight_decay)]
    weight_decay: f32,
    /// GPT: clip the gradients' global norm to this (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    clip: f32,
    /// GPT: the validation loss every this many steps.
    #[arg(long, default_value_t = LmTrainConfig::default().eval_every)]
    eval_every: u64,
    /// GPT: batches of held-out windows per validation loss.
    #[arg(long, default_value_t = LmTrainConfig::default().eval_batches)]
    eval_batches: usize,
    /// GPT: the model folder written at the end.
    #[arg(long, default_value = "out/gpt")]
    out: PathBuf,
    /// GPT: tokens of the sample generated at the end (0: none).
    #[arg(long, default_value_t = 200)]
    sample_tokens: usize,
}

fn config(args: &TrainArgs) -> wgrad::Result<LmTrainConfig> {
    let refuse = |flag: &str| {
        Err(wgrad::Error::InvalidArgument {
            op: "train --model gpt",
            reason: format!("{flag} is not supported for the GPT yet (GPT data, tensor and pipeline parallel is issue 14); use --model mlp"),
        })
    };
    if args.parallel.is_some() {
        return refuse("--parallel");
    }
    if args.distributed.is_some() {
        return refuse("--distributed");
    }
    if args.mnist.is_some() {
        return Err(wgrad::Error::InvalidArgument { op: "train --model gpt", reason: "--mnist is for --model mlp; the GPT takes --text".into() });
    }
    let g = &args.gpt;
    let defaults = LmTrainConfig::default();
    Ok(LmTrainConfig {
        text: g.text.clone().map_or(TextSource::Shakespeare, TextSource::File),
        tokenizer: match g.tokenizer {
            TokenizerName::Char => TokenizerKind::Char,
            TokenizerName::Gpt2 => TokenizerKind::Gpt2,
        },
        n_layer: g.n_layer,
        n_head: g.n_head,
        n_embd: g.n_embd,
        block_size: g.block_size,
        batch_size: args.batch_size.unwrap_or(defaults.batch_size),
        max_steps: args.max_steps.unwrap_or(defaults.max_steps),
        lr: args.lr.unwrap_or(defaults.lr),
        min_lr: g.min_lr,
        warmup_steps: g.warmup_steps,
        weight_decay: g.weight_decay,
        betas: defaults.betas,
        clip_grad_norm: (g.clip > 0.0).then_some(g.clip),
        eval_every: g.eval_every,
        eval_batches: g.eval_batches,
        validation_fraction: defaults.validation_fraction,
        loss_every: args.loss_every,
        seed: args.seed,
        resume: args.resume.clone(),
    })
}

/// A spinner while kernels are prepared, then a bar over the steps with the
/// loss, tokens/s and the ETA.
#[derive(Default)]
struct Bars {
    preparing: Option<ProgressBar>,
    steps: Option<ProgressBar>,
}

impl LmProgress for Bars {
    fn preparing(&mut self) {
        self.preparing = Some(spinner("preparing kernels"));
    }

    fn started(&mut self, info: &LmRunInfo) {
        if let Some(s) = self.preparing.take() {
            s.finish_and_clear();
        }
        println!("device: {}", info.device);
        println!("model: {} | {} parameters", info.model, info.parameters);
        println!(
            "data: {} tokenizer, vocabulary {}, {} train / {} validation tokens | {} tokens per step",
            info.tokenizer, info.vocab_size, info.train_tokens, info.validation_tokens, info.tokens_per_step
        );
        println!("{} dispatches per step, {} KiB of GPU memory", info.dispatches_per_step, info.peak_gpu_bytes / 1024);
        let bar = ProgressBar::new(info.steps);
        bar.set_style(
            ProgressStyle::with_template("{spinner} {bar:30} {pos}/{len} steps {elapsed_precise} (ETA {eta}) {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        bar.enable_steady_tick(std::time::Duration::from_millis(120));
        bar.set_message("first steps compile kernels (cached for later runs)");
        self.steps = Some(bar);
    }

    fn step(&mut self, _step: u64) {
        if let Some(bar) = &self.steps {
            bar.inc(1);
        }
    }

    fn loss(&mut self, _step: u64, loss: f32, tokens_per_s: f64) {
        if let Some(bar) = &self.steps {
            bar.set_message(format!("loss {loss:.4} | {tokens_per_s:.0} tokens/s"));
        }
    }

    fn validation(&mut self, step: u64, loss: f32) {
        let line = format!("step {step}: validation loss {loss:.4}");
        // Printed through the bar so it stays above it; `suspend` prints
        // even where the bar is hidden (output not a terminal).
        match &self.steps {
            Some(bar) => bar.suspend(|| println!("{line}")),
            None => println!("{line}"),
        }
    }
}

pub fn train(opts: &DeviceOptions, args: &TrainArgs) -> wgrad::Result<()> {
    let config = config(args)?;
    let mut bars = Bars::default();
    let mut run = LmTrainingRun::new(opts, config, &mut bars)?;
    let summary = run.fit(&mut bars)?;
    if let Some(bar) = bars.steps.take() {
        bar.finish();
    }
    println!(
        "trained {} steps in {:.1} s: {:.0} ms/step, {:.0} tokens/s",
        summary.steps, summary.train_seconds, summary.ms_per_step, summary.tokens_per_s
    );
    println!("final validation loss {:.4}", summary.final_validation_loss);
    run.save(&args.gpt.out)?;
    println!("model folder: {}", args.gpt.out.display());
    let title = format!("{} — validation loss {:.4}", run.info().model, summary.final_validation_loss);
    plot::loss_curves(&args.plot, &title, &[("train", &summary.train_curve), ("validation", &summary.validation_curve)])?;
    println!("loss curves: {}", args.plot.display());
    Ok(())
}
