//! A model's own tokenizer built from a GGUF file's metadata
//! (`BpeTokenizer::from_gguf`), on arbitrary bytes; a tokenizer that
//! builds then encodes, decodes and streams a fixed text, spells every
//! token, and renders the file's chat template.
#![no_main]

use libfuzzer_sys::fuzz_target;
use wgrad::io::bpe::BpeTokenizer;
use wgrad::io::chat::{render_chat, ChatMessage};
use wgrad::io::gguf::Gguf;

/// Specials (ChatML's, Gemma's), multi-byte characters, digits, whitespace
/// and newline runs, a SentencePiece space.
const TEXT: &str =
    "<|im_start|>user\nHello, wörld! 12345 日本語 🙂\t\t  x<|im_end|>\n<|endoftext|><start_of_turn>model\n\n\n▁a<end_of_turn>";

fuzz_target!(|data: &[u8]| {
    let Ok(g) = Gguf::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    let Ok(tok) = BpeTokenizer::from_gguf(&g) else { return };
    if let Ok(ids) = tok.encode(TEXT, true) {
        let _ = tok.decode(&ids, false);
        let mut stream = tok.stream(true);
        for &id in &ids {
            let _ = stream.push(id);
        }
        let _ = stream.finish();
    }
    // Bounded by the file: each token took at least 8 bytes of it.
    for id in 0..u32::try_from(tok.vocab_size()).unwrap_or(u32::MAX) {
        let _ = (tok.token(id), tok.token_bytes(id), tok.is_special(id));
    }
    let _ = tok.decode(&[u32::MAX], false);
    if let Some(template) = tok.chat_template() {
        let (bos, eos) = (tok.bos_token().unwrap_or_default(), tok.eos_token().unwrap_or_default());
        let _ = render_chat(
            template,
            &[ChatMessage::system("s"), ChatMessage::user("hi")],
            true,
            &bos,
            &eos,
        );
    }
});
