//! The GGUF reader on arbitrary bytes (gguf_input.rs: parse, read and
//! dequantize every tensor, load the file as a model, quantized and f32).
//! Any panic, hang (`-timeout`), or allocation over `-malloc_limit_mb` is
//! a finding; errors are the expected outcome for most inputs.
#![no_main]

use libfuzzer_sys::fuzz_target;

mod gguf_input;

fuzz_target!(|data: &[u8]| {
    let _ = gguf_input::run(data);
});
