//! The GGUF reader on arbitrary bytes: parse, then read and decode every
//! tensor and query the Llama mapping. Any panic, hang, or allocation over
//! libFuzzer's `-malloc_limit_mb` (default: the RSS limit) is a finding;
//! errors are the expected outcome for most inputs.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wgrad::io::gguf::{llama, Gguf};

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes("fuzz.gguf", data.to_vec()) else { return };
    for (key, _) in g.metadata() {
        let _ = g.get_str(key);
        let _ = g.get_u64(key);
        let _ = g.get_f32(key);
        let _ = g.get_strings(key);
    }
    let hp = llama::Hparams::from_gguf(&g).ok();
    for t in g.tensors() {
        let _ = t.shape();
        let _ = g.read_raw(&t.name);
        let _ = g.read_f32(&t.name);
        if let Some(hp) = &hp {
            let _ = llama::read_hf_f32(&g, &t.name, hp);
        }
    }
});
