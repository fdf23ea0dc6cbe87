//! The gguf target's body, a module of its own so that
//! tests/suite/fuzz_seeds.rs replays every committed seed through the same
//! calls without cargo-fuzz: parse, then read and dequantize every tensor
//! and map it to its Hugging Face name and row order, and load the file as
//! a model (`GgufModel`; its matrices as the kernels take them, then as
//! f32 weights).

use wgrad::io::gguf::{dequantize, llama, Gguf};
use wgrad::io::gguf_model::GgufModel;

/// Every reader call on `data`. The result is the file's as a model: the
/// first error of parsing it, loading it, keeping its matrices quantized
/// or de-quantizing them (each is tried whatever the one before gave).
pub fn run(data: &[u8]) -> wgrad::Result<()> {
    let g = Gguf::from_bytes("fuzz.gguf", data.to_vec())?;
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
    let model = GgufModel::from_gguf(g)?;
    // What `wgrad generate` loads (matrices kept quantized), then what
    // `train --init` loads (every weight f32).
    let storage = model.quantized_storage();
    let quantized = model.to_quantized_causal_lm();
    let f32 = model.to_causal_lm();
    storage?;
    quantized?;
    f32?;
    Ok(())
}
