//! A tokenizer built from a GGUF file's metadata, on arbitrary bytes.
//!
//! Until the GGUF tokenizer builder lands, this target parses the file and
//! makes the lookups such a builder makes (`tokenizer.ggml.*`: model and
//! pre-tokenizer names, tokens, merges split into pairs of known tokens,
//! token types, scores, special ids checked against the vocabulary, the
//! chat template). When it lands, replace `build` with a call to it (e.g.
//! `wgrad::io::bpe::…::from_gguf(&g)`), keeping the parse in front: the
//! builder is what must turn every input into a value or an error.
#![no_main]

use std::collections::HashMap;

use libfuzzer_sys::fuzz_target;
use wgrad::io::gguf::{Array, Gguf};

/// What the builder reads, each lookup's error ignored as a builder would
/// report it.
fn build(g: &Gguf) {
    let _ = g.get_str("tokenizer.ggml.model");
    let _ = g.get_str("tokenizer.ggml.pre");
    let _ = g.get_str("tokenizer.chat_template");
    let _ = g.get_bool("tokenizer.ggml.add_bos_token");
    let Ok(tokens) = g.get_strings("tokenizer.ggml.tokens") else { return };
    let ids: HashMap<&str, usize> = tokens.iter().enumerate().map(|(i, t)| (t.as_str(), i)).collect();
    if let Ok(merges) = g.get_strings("tokenizer.ggml.merges") {
        for merge in merges {
            if let Some((a, b)) = merge.split_once(' ') {
                let _ = (ids.get(a), ids.get(b), ids.get(format!("{a}{b}").as_str()));
            }
        }
    }
    if let Ok(Array::I32(types)) = g.get_array("tokenizer.ggml.token_type") {
        let _ = types.iter().zip(tokens).filter(|(&ty, _)| ty == 3 || ty == 4).count();
    }
    if let Ok(Array::F32(scores)) = g.get_array("tokenizer.ggml.scores") {
        let _ = scores.len() == tokens.len();
    }
    for key in ["bos_token_id", "eos_token_id", "padding_token_id", "unknown_token_id"] {
        if let Ok(id) = g.get_u64(&format!("tokenizer.ggml.{key}")) {
            let _ = usize::try_from(id).ok().and_then(|i| tokens.get(i));
        }
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(g) = Gguf::from_bytes("fuzz.gguf", data.to_vec()) {
        build(&g);
    }
});
