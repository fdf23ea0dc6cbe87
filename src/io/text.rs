//! Text for language models: the shipped Shakespeare, a character-level
//! tokenizer, a held-out split by position, and random training windows.

use std::collections::HashMap;
use std::io::Read;

use rand::Rng;

use crate::error::{Error, Result};
use crate::io::bpe::BpeTokenizer;

// Natively the text is part of the library; the browser build leaves its
// 2 MB out of the .wasm, and the page fetches data/shakespeare.txt.gz.
#[cfg(not(target_arch = "wasm32"))]
const SHAKESPEARE_GZ: &[u8] = include_bytes!("../../data/shakespeare.txt.gz");

/// Shakespeare's 42 plays and poems as one text (5,057,323 bytes of ASCII;
/// data/README.md gives its source and licence). In a browser the text is
/// not embedded: decompress the served `data/shakespeare.txt.gz` with
/// [`gunzip_text`] and train on it as `TextSource::Text`.
pub fn shakespeare() -> Result<String> {
    #[cfg(not(target_arch = "wasm32"))]
    return gunzip_text("shakespeare", SHAKESPEARE_GZ);
    #[cfg(target_arch = "wasm32")]
    Err(Error::InvalidArgument {
        op: "shakespeare",
        reason: "the browser build does not embed the text: fetch data/shakespeare.txt.gz, decompress it with \
                 gunzip_text and pass it as TextSource::Text"
            .into(),
    })
}

/// The UTF-8 text a gzip stream holds (the shipped Shakespeare, or the
/// bytes a page fetched); `op` names the caller in errors.
pub fn gunzip_text(op: &'static str, gz: &[u8]) -> Result<String> {
    let mut text = String::with_capacity(gz.len().saturating_mul(3));
    flate2::read::GzDecoder::new(gz)
        .read_to_string(&mut text)
        .map_err(|e| Error::InvalidArgument {
            op,
            reason: format!("the {} bytes are not gzip-compressed UTF-8 text: {e}", gz.len()),
        })?;
    Ok(text)
}

/// One token per character, over the characters of a training text (sorted,
/// as nanoGPT's shakespeare_char does). Its vocabulary is a string, to be
/// stored beside a checkpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CharTokenizer {
    chars: Vec<char>,
    ids: HashMap<char, u32>,
}

impl CharTokenizer {
    /// The distinct characters of `text`, sorted.
    pub fn from_text(text: &str) -> Result<Self> {
        let mut chars: Vec<char> = text.chars().collect();
        chars.sort_unstable();
        chars.dedup();
        Self::from_chars(chars)
    }

    /// A tokenizer with exactly this vocabulary, in this order (as
    /// [`CharTokenizer::vocabulary`] wrote it).
    pub fn from_vocabulary(vocabulary: &str) -> Result<Self> {
        let chars: Vec<char> = vocabulary.chars().collect();
        let mut sorted = chars.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if sorted.len() != chars.len() {
            return Err(Error::InvalidArgument {
                op: "CharTokenizer",
                reason: "the vocabulary repeats a character".into(),
            });
        }
        Self::from_chars(chars)
    }

    fn from_chars(chars: Vec<char>) -> Result<Self> {
        if chars.is_empty() {
            return Err(Error::InvalidArgument {
                op: "CharTokenizer",
                reason: "an empty vocabulary".into(),
            });
        }
        let ids = chars.iter().enumerate().map(|(i, &c)| (c, i as u32)).collect();
        Ok(CharTokenizer { chars, ids })
    }

    pub fn vocab_size(&self) -> usize {
        self.chars.len()
    }

    /// Every character in token order.
    pub fn vocabulary(&self) -> String {
        self.chars.iter().collect()
    }

    /// Token ids of `text`; a character outside the vocabulary is an error
    /// naming it and its position.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        text.chars()
            .enumerate()
            .map(|(i, c)| match self.ids.get(&c) {
                Some(&id) => Ok(id),
                None => Err(Error::InvalidArgument {
                    op: "CharTokenizer::encode",
                    reason: format!(
                        "character {c:?} at position {i} is not in the vocabulary of {}",
                        self.chars.len()
                    ),
                }),
            })
            .collect()
    }

    /// The text of token `ids`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        ids.iter()
            .map(|&id| {
                self.chars
                    .get(id as usize)
                    .copied()
                    .ok_or_else(|| Error::InvalidArgument {
                        op: "CharTokenizer::decode",
                        reason: format!("id {id} is outside the vocabulary of {}", self.chars.len()),
                    })
            })
            .collect()
    }
}

/// Splits tokens into training and validation at one position: the last
/// `validation_fraction` of the text is held out whole (for Shakespeare,
/// the last plays), never random lines.
pub fn held_out_split(tokens: &[u32], validation_fraction: f64) -> Result<(&[u32], &[u32])> {
    if !(validation_fraction > 0.0 && validation_fraction < 1.0) {
        return Err(Error::InvalidArgument {
            op: "held_out_split",
            reason: format!("the fraction must be in (0, 1), got {validation_fraction}"),
        });
    }
    let cut = ((tokens.len() as f64) * (1.0 - validation_fraction)).round() as usize;
    if cut == 0 || cut == tokens.len() {
        return Err(Error::InvalidArgument {
            op: "held_out_split",
            reason: format!("{} tokens leave one side empty", tokens.len()),
        });
    }
    Ok(tokens.split_at(cut))
}

/// `batch` random windows of `block_size + 1` tokens: inputs [batch,
/// block_size] and targets, the same windows one token later.
pub fn random_windows(
    tokens: &[u32],
    batch: usize,
    block_size: usize,
    rng: &mut impl Rng,
) -> Result<(Vec<u32>, Vec<u32>)> {
    if batch == 0 || block_size == 0 || tokens.len() <= block_size {
        return Err(Error::InvalidArgument {
            op: "random_windows",
            reason: format!(
                "{} tokens cannot give windows of {} (batch {batch})",
                tokens.len(),
                block_size + 1
            ),
        });
    }
    let (mut inputs, mut targets) = (
        Vec::with_capacity(batch * block_size),
        Vec::with_capacity(batch * block_size),
    );
    for _ in 0..batch {
        let start = rng.random_range(0..tokens.len() - block_size);
        inputs.extend_from_slice(&tokens[start..start + block_size]);
        targets.extend_from_slice(&tokens[start + 1..start + block_size + 1]);
    }
    Ok((inputs, targets))
}

/// GPT-2's byte-level BPE (`r50k_base`, 50,257 tokens) through tiktoken-rs,
/// whose ranks ship inside the crate: nothing is downloaded.
#[derive(Clone)]
pub struct Gpt2Bpe {
    bpe: tiktoken_rs::CoreBPE,
}

impl std::fmt::Debug for Gpt2Bpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Gpt2Bpe(r50k_base)")
    }
}

impl Gpt2Bpe {
    /// GPT-2's vocabulary: 50,000 merges, 256 bytes and `<|endoftext|>`.
    pub const VOCAB_SIZE: usize = 50257;
    /// `<|endoftext|>`.
    pub const END_OF_TEXT: u32 = 50256;

    pub fn new() -> Result<Self> {
        let bpe = tiktoken_rs::r50k_base().map_err(|e| Error::Internal {
            op: "Gpt2Bpe",
            reason: format!("the r50k_base ranks do not load: {e}"),
        })?;
        Ok(Gpt2Bpe { bpe })
    }

    /// Token ids of `text`; `<|endoftext|>` in the text is ordinary text,
    /// as GPT-2's tokenizer treats it by default.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        self.bpe.encode_ordinary(text)
    }

    /// The bytes of `ids`: a token can hold part of a UTF-8 character, so
    /// streaming output joins bytes before turning them into text.
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= Self::VOCAB_SIZE) {
            return Err(Error::InvalidArgument {
                op: "Gpt2Bpe::decode",
                reason: format!("id {bad} is outside the vocabulary of {}", Self::VOCAB_SIZE),
            });
        }
        self.bpe.decode_bytes(ids).map_err(|e| Error::InvalidArgument {
            op: "Gpt2Bpe::decode",
            reason: e.to_string(),
        })
    }
}

/// Which tokenizer a language model uses, and its vocabulary where it is
/// not built in.
#[derive(Clone, Debug)]
pub enum Tokenizer {
    Char(CharTokenizer),
    Gpt2(Gpt2Bpe),
    /// A pretrained model's own BPE (a GGUF file's, a folder's
    /// tokenizer.json), encoding plain text: no BOS added.
    Bpe(Box<BpeTokenizer>),
}

impl Tokenizer {
    pub fn vocab_size(&self) -> usize {
        match self {
            Tokenizer::Char(t) => t.vocab_size(),
            Tokenizer::Gpt2(_) => Gpt2Bpe::VOCAB_SIZE,
            Tokenizer::Bpe(t) => t.vocab_size(),
        }
    }

    /// `char` or `gpt2`, as `--tokenizer` takes it.
    pub fn kind(&self) -> &'static str {
        match self {
            Tokenizer::Char(_) => "char",
            Tokenizer::Gpt2(_) => "gpt2",
            Tokenizer::Bpe(_) => "the model's own BPE",
        }
    }

    /// Token ids; with the char tokenizer a character outside its
    /// vocabulary is an error naming it.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        match self {
            Tokenizer::Char(t) => t.encode(text),
            Tokenizer::Gpt2(t) => Ok(t.encode(text)),
            Tokenizer::Bpe(t) => t.encode(text, false),
        }
    }

    /// The bytes of `ids` (UTF-8 once whole characters are joined).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        match self {
            Tokenizer::Char(t) => Ok(t.decode(ids)?.into_bytes()),
            Tokenizer::Gpt2(t) => t.decode_bytes(ids),
            Tokenizer::Bpe(t) => t.decode_bytes(ids, false),
        }
    }

    /// The text of `ids`; bytes that are not whole UTF-8 characters become
    /// U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned())
    }
}

/// Turns a stream of token bytes into text as soon as characters are whole:
/// a BPE token may end inside a multi-byte character.
#[derive(Clone, Debug, Default)]
pub struct Utf8Stream {
    pending: Vec<u8>,
}

impl Utf8Stream {
    /// The text that `bytes` completes; an incomplete character waits for
    /// the next call, and an invalid sequence comes out as U+FFFD.
    pub fn push(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        loop {
            match std::str::from_utf8(&self.pending) {
                Ok(text) => {
                    out.push_str(text);
                    self.pending.clear();
                    return out;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    out.push_str(&String::from_utf8_lossy(&self.pending[..valid]));
                    match e.error_len() {
                        // Incomplete at the end: keep it for the next token.
                        None => {
                            self.pending.drain(..valid);
                            return out;
                        }
                        Some(len) => {
                            out.push('\u{FFFD}');
                            self.pending.drain(..valid + len);
                        }
                    }
                }
            }
        }
    }

    /// What is left at the end of the stream (an incomplete character as
    /// U+FFFD).
    pub fn finish(&mut self) -> String {
        let rest = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        rest
    }
}
