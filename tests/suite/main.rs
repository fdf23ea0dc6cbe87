//! The test suite as one binary. One process shares each adapter's
//! `Kernels` (and so its compiled pipelines) across every file, links once,
//! and runs tests of different files side by side; each file is a module.
//!
//! Run one file's tests with a filter: `cargo test --release --test suite rowwise::`.

mod common;

mod activation_checkpointing;
mod batch;
mod checkpoint;
mod data;
mod data_parallel_precision;
mod device;
mod dropout;
mod f16_weights;
mod finetune;
mod flash_attention;
mod fusion;
mod fuzz_seeds;
mod gemma_folder;
mod gemma_gguf;
mod gemma_parallel;
mod gemma_reference;
mod generate;
mod gguf;
mod gguf_model;
mod gpt_data_parallel;
mod gpt_folder;
mod gpt_pipeline;
mod gpt_reference;
mod gpt_tensor;
mod graph;
mod kernels;
mod kernels_ext;
mod large_operands;
mod layers;
mod llama_folder;
mod llama_kernels;
mod llama_parallel;
mod llama_reference;
mod lm_training;
mod lora;
mod lora_export;
mod matvec;
mod mistral_folder;
mod mixed_precision;
mod modules;
mod multi_lora;
mod optim;
mod parallel;
mod parallel_f16_checkpointing;
mod perplexity;
mod pipeline_cache;
mod qlora;
mod quant_weights;
mod qwen_folder;
mod qwen_parallel;
mod qwen_reference;
mod rowwise;
mod sampling;
mod shaders;
mod tensor;
mod text;
mod tokenizer;
mod train;
mod training;
mod webgpu;
mod zero;
