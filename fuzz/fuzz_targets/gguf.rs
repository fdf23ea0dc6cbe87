//! The GGUF reader on arbitrary bytes: parse, then read and dequantize
//! every tensor and map it to its Hugging Face name and row order, and
//! load the file as a model (`GgufModel`, then f32 weights). Any
//! panic, hang (`-timeout`), or allocation over `-malloc_limit_mb` is a
//! finding; errors are the expected outcome for most inputs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wgrad::io::gguf::{dequantize, llama, Gguf};
use wgrad::io::gguf_model::GgufModel;

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for (key, _) in g.metadata() {
        let _ = g.get_str(key);
        let _ = g.get_u64(key);
        let _ = g.get_f32(key);
        let _ = g.get_bool(key);
        let _ = g.get_strings(key);
    }
    let hp = llama::Hparams::from_gguf(&g).ok();
    for t in g.tensors() {
        let _ = (t.shape(), t.row_len(), t.row_bytes());
        let _ = llama::hf_name(&t.name);
        // Every type, decoded or not: dequantize refuses the ones it does not know.
        if let Ok(raw) = g.read_raw(&t.name) {
            let _ = dequantize(t.ty, &raw);
        }
        let _ = g.read_f32(&t.name);
        // The kernels' path: the raw blocks, scales checked.
        let _ = g.read_quantized(&t.name);
        if let Some(hp) = &hp {
            let _ = llama::read_hf_f32(&g, &t.name, hp);
        }
    }
    if let Ok(model) = GgufModel::from_gguf(g) {
        let _ = model.to_causal_lm();
    }
});
