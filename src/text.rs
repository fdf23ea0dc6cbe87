//! Text for language models: the shipped Shakespeare, a character-level
//! tokenizer, a held-out split by position, and random training windows.

use std::collections::HashMap;
use std::io::Read;

use rand::Rng;

use crate::error::{Error, Result};

const SHAKESPEARE_GZ: &[u8] = include_bytes!("../data/shakespeare.txt.gz");

/// Shakespeare's 42 plays and poems as one text (5,057,323 bytes of ASCII;
/// data/README.md gives its source and licence).
pub fn shakespeare() -> Result<String> {
    let mut text = String::with_capacity(5_100_000);
    flate2::read::GzDecoder::new(SHAKESPEARE_GZ).read_to_string(&mut text).map_err(|e| Error::InvalidArgument {
        op: "shakespeare",
        reason: format!("the embedded text does not decompress: {e}"),
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
            return Err(Error::InvalidArgument { op: "CharTokenizer", reason: "the vocabulary repeats a character".into() });
        }
        Self::from_chars(chars)
    }

    fn from_chars(chars: Vec<char>) -> Result<Self> {
        if chars.is_empty() {
            return Err(Error::InvalidArgument { op: "CharTokenizer", reason: "an empty vocabulary".into() });
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
                    reason: format!("character {c:?} at position {i} is not in the vocabulary of {}", self.chars.len()),
                }),
            })
            .collect()
    }

    /// The text of token `ids`; an id outside the vocabulary is an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        ids.iter()
            .map(|&id| {
                self.chars.get(id as usize).copied().ok_or_else(|| Error::InvalidArgument {
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
        return Err(Error::InvalidArgument { op: "held_out_split", reason: format!("the fraction must be in (0, 1), got {validation_fraction}") });
    }
    let cut = ((tokens.len() as f64) * (1.0 - validation_fraction)).round() as usize;
    if cut == 0 || cut == tokens.len() {
        return Err(Error::InvalidArgument { op: "held_out_split", reason: format!("{} tokens leave one side empty", tokens.len()) });
    }
    Ok(tokens.split_at(cut))
}

/// `batch` random windows of `block_size + 1` tokens: inputs [batch,
/// block_size] and targets, the same windows one token later.
pub fn random_windows(tokens: &[u32], batch: usize, block_size: usize, rng: &mut impl Rng) -> Result<(Vec<u32>, Vec<u32>)> {
    if batch == 0 || block_size == 0 || tokens.len() <= block_size {
        return Err(Error::InvalidArgument {
            op: "random_windows",
            reason: format!("{} tokens cannot give windows of {} (batch {batch})", tokens.len(), block_size + 1),
        });
    }
    let (mut inputs, mut targets) = (Vec::with_capacity(batch * block_size), Vec::with_capacity(batch * block_size));
    for _ in 0..batch {
        let start = rng.random_range(0..tokens.len() - block_size);
        inputs.extend_from_slice(&tokens[start..start + block_size]);
        targets.extend_from_slice(&tokens[start + 1..start + block_size + 1]);
    }
    Ok((inputs, targets))
}
