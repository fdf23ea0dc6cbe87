//! SentencePiece-style vocabularies from a GGUF file's metadata
//! (`tokenizer.ggml.model = llama`: Llama 2, TinyLlama, Mistral, Gemma),
//! built as the same `tokenizers` pipeline transformers' GGUF converter
//! builds (`integrations/gguf/gguf_tokenizer_mapping.py`, transformers 5):
//! a BPE model with byte fallback (`<0xNN>` tokens for bytes the
//! vocabulary lacks) whose merges are recovered from the vocabulary —
//! every split of a token into two tokens, best first by the token's score
//! (transformers' `generate_merges`) — and `▁` standing for a space.
//!
//! Three flavours, picked by architecture as the converter picks them:
//! - Llama (every architecture not named below): a Metaspace pre-tokenizer
//!   that turns spaces into `▁` and puts one `▁` before the text; decoding
//!   strips that one leading space again.
//! - Gemma (`gemma`, `gemma2`, `gemma3`): spaces become `▁` in a normalizer,
//!   no prefix; merges ordered by the tokens' positions in the file (Gemma's
//!   scores do not follow its merge order), and tokens that are runs of
//!   spaces (stored with real spaces) respelled as runs of `▁`.
//! - Phi-3 (`phi3`): the prefix `▁` comes from a normalizer, not Metaspace.
//!
//! Where the file says `tokenizer.ggml.add_space_prefix = false` for the
//! Llama flavour, no `▁` is put first (llama.cpp's reading; transformers'
//! converter ignores the key).

use tokenizers::decoders::byte_fallback::ByteFallback;
use tokenizers::decoders::fuse::Fuse;
use tokenizers::decoders::sequence::Sequence as DecoderSequence;
use tokenizers::decoders::strip::Strip;
use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::normalizers::{Prepend, Replace, Sequence as NormalizerSequence};
use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, NormalizerWrapper, PreTokenizerWrapper, SplitDelimiterBehavior};

/// The character SentencePiece writes for a space.
pub const SPACE: char = '\u{2581}';

/// The longest token whose merges are recovered from the vocabulary.
const MAX_DERIVED_TOKEN_BYTES: usize = 1024;

/// llama.cpp's token types that are matched whole in the text.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// How a SentencePiece-style vocabulary turns text into pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpmFlavor {
    /// Metaspace pre-tokenizer; `prefix_space` puts a `▁` before the text
    /// (and decoding strips one leading space).
    Llama { prefix_space: bool },
    /// Spaces to `▁` in a normalizer, no prefix, merges by file position.
    Gemma,
    /// A `▁` prepended and spaces replaced in a normalizer.
    Phi3,
}

impl SpmFlavor {
    /// The flavour transformers' converter gives an architecture.
    pub fn for_architecture(architecture: &str, add_space_prefix: Option<bool>) -> Self {
        match architecture {
            "gemma" | "gemma2" | "gemma3" => SpmFlavor::Gemma,
            "phi3" => SpmFlavor::Phi3,
            _ => SpmFlavor::Llama {
                prefix_space: add_space_prefix.unwrap_or(true),
            },
        }
    }

    /// Whether decoding drops one leading space (the one the prefix added).
    pub fn strips_leading_space(self) -> bool {
        matches!(self, SpmFlavor::Llama { prefix_space: true } | SpmFlavor::Phi3)
    }
}

/// What a GGUF file's SentencePiece-style vocabulary says.
pub struct SpmVocabulary<'a> {
    pub tokens: &'a [String],
    /// `tokenizer.ggml.scores`, one per token (needed unless `merges` is
    /// given or the flavour is Gemma, which orders by position).
    pub scores: Option<&'a [f32]>,
    /// `tokenizer.ggml.merges` when the file lists them (`"a b"`).
    pub merges: Option<&'a [String]>,
    /// llama.cpp token types, one per token.
    pub types: &'a [i64],
    /// bos, eos, unknown and padding ids the metadata names: transformers
    /// makes each a special token matched whole in the text.
    pub named_special: &'a [u32],
}

/// The built tokenizer and, per id, the bytes it decodes to and whether it
/// is special (left out by `decode(…, skip_special = true)`).
pub struct SpmTokenizer {
    pub inner: tokenizers::Tokenizer,
    pub token_bytes: Vec<Option<Box<[u8]>>>,
    pub special: Vec<bool>,
}

/// Whether Python's `str.isspace` holds for `c` (Rust's `is_whitespace`
/// plus the four information separators U+001C..U+001F).
fn python_isspace(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

/// The converter's Gemma respelling: a token of whitespace holding a space
/// becomes that many `▁` (Gemma's files store `"  "` for `"▁▁"`).
fn gemma_spelling(token: &str) -> String {
    if token.contains(' ') && token.chars().all(python_isspace) {
        std::iter::repeat_n(SPACE, token.chars().count()).collect()
    } else {
        token.to_string()
    }
}

/// The bytes one token decodes to, as the converter's decoder chain
/// (Replace `▁` → space, ByteFallback, Fuse) gives them: `<0xNN>` is the
/// byte NN, anything else its text with `▁` as a space.
pub fn token_bytes(token: &str) -> Box<[u8]> {
    if token.len() == 6 && token.starts_with("<0x") && token.ends_with('>') {
        if let Ok(byte) = u8::from_str_radix(&token[3..5], 16) {
            return Box::new([byte]);
        }
    }
    token.replace(SPACE, " ").into_bytes().into_boxed_slice()
}

/// Whether a `tokenizer.json` decoder (as JSON) is the SentencePiece chain
/// the converters write — Replace `▁` with a space, ByteFallback, Fuse, and
/// for a vocabulary that puts a space first, Strip one leading space —
/// and if so whether it strips (`None` for any other decoder).
pub fn decoder_strips(decoder: &serde_json::Value) -> Option<bool> {
    let steps = decoder.get("decoders")?.as_array()?;
    let kind = |step: &serde_json::Value| step.get("type").and_then(|t| t.as_str()).map(str::to_string);
    let replace = serde_json::json!({"type": "Replace", "pattern": {"String": SPACE.to_string()}, "content": " "});
    let strip = serde_json::json!({"type": "Strip", "content": " ", "start": 1, "stop": 0});
    match steps.as_slice() {
        [r, b, f, rest @ ..]
            if decoder.get("type")? == "Sequence"
                && *r == replace
                && kind(b)? == "ByteFallback"
                && kind(f)? == "Fuse" =>
        {
            match rest {
                [] => Some(false),
                [s] if *s == strip => Some(true),
                _ => None,
            }
        }
        _ => None,
    }
}

/// transformers' `generate_merges`: every split of every token into two
/// tokens of the vocabulary, the token's pairs in the order of their ids,
/// then all sorted best first by (score, left length, right length) with
/// ties kept in vocabulary order. `keys` is each distinct token once, in
/// order of first appearance, with its score (its last one when repeated).
fn generate_merges(keys: &[(&str, f64)], vocab: &Vocab) -> Vec<(String, String)> {
    struct Merge<'t> {
        left: &'t str,
        right: &'t str,
        score: f64,
        left_chars: usize,
        right_chars: usize,
    }
    let mut merges = Vec::new();
    let mut local = Vec::new();
    for &(token, score) in keys {
        local.clear();
        let chars = token.chars().count();
        for (n, (at, _)) in token.char_indices().enumerate().skip(1) {
            let (left, right) = token.split_at(at);
            if let (Some(&l), Some(&r)) = (vocab.get(left), vocab.get(right)) {
                local.push((
                    l,
                    r,
                    Merge {
                        left,
                        right,
                        score,
                        left_chars: n,
                        right_chars: chars - n,
                    },
                ));
            }
        }
        local.sort_by_key(|&(l, r, _)| (l, r));
        merges.extend(local.drain(..).map(|(_, _, m)| m));
    }
    // A stable sort, descending: Python's `sorted(…, reverse=True)` keeps
    // equal keys in their original order too.
    merges.sort_by(|a, b| {
        b.score
            .total_cmp(&a.score)
            .then(b.left_chars.cmp(&a.left_chars))
            .then(b.right_chars.cmp(&a.right_chars))
    });
    merges
        .into_iter()
        .map(|m| (m.left.to_string(), m.right.to_string()))
        .collect()
}

/// Each distinct token once, in order of first appearance, with a score
/// (`score(id)`) taken from its last appearance, as a Python dict built
/// from the (token, score) pairs holds them.
fn first_seen_last_scored(spelled: &[String], score: impl Fn(usize) -> f64) -> Vec<(&str, f64)> {
    let mut slot: std::collections::HashMap<&str, usize> = std::collections::HashMap::with_capacity(spelled.len());
    let mut keys: Vec<(&str, f64)> = Vec::with_capacity(spelled.len());
    for (id, token) in spelled.iter().enumerate() {
        match slot.get(token.as_str()) {
            Some(&at) => keys[at].1 = score(id),
            None => {
                slot.insert(token, keys.len());
                keys.push((token, score(id)));
            }
        }
    }
    keys
}

/// The merges: the file's own when it lists them, else recovered from the
/// scores (Gemma: from the positions).
fn merges(
    v: &SpmVocabulary,
    flavor: SpmFlavor,
    spelled: &[String],
    vocab: &Vocab,
) -> Result<Vec<(String, String)>, String> {
    if let Some(listed) = v.merges {
        let mut pairs = Vec::with_capacity(listed.len());
        for (i, merge) in listed.iter().enumerate() {
            let (a, b) = merge
                .split_once(' ')
                .ok_or_else(|| format!("merge {i} `{merge}` is not two tokens separated by a space"))?;
            for part in [a, b, &format!("{a}{b}")] {
                if !vocab.contains_key(part) {
                    return Err(format!(
                        "merge {i} `{merge}` needs `{part}`, which is not in the vocabulary"
                    ));
                }
            }
            pairs.push((a.to_string(), b.to_string()));
        }
        return Ok(pairs);
    }
    // Recovering merges costs the square of a token's length: a corrupt
    // file's megabyte-long token would stall the load. Real pieces are
    // short (SentencePiece's default cap is 16 characters).
    if let Some((id, token)) = spelled
        .iter()
        .enumerate()
        .find(|(_, t)| t.len() > MAX_DERIVED_TOKEN_BYTES)
    {
        return Err(format!(
            "token {id} is {} bytes long; wgrad recovers merges for tokens of up to {MAX_DERIVED_TOKEN_BYTES} bytes",
            token.len()
        ));
    }
    let keys = if flavor == SpmFlavor::Gemma {
        first_seen_last_scored(spelled, |id| -(id as f64))
    } else {
        let scores = v
            .scores
            .ok_or("has no `tokenizer.ggml.scores` and no `tokenizer.ggml.merges`, so the merge order is unknown")?;
        if scores.len() != spelled.len() {
            return Err(format!(
                "`tokenizer.ggml.scores` has {} entries for {} tokens",
                scores.len(),
                spelled.len()
            ));
        }
        if let Some(id) = scores.iter().position(|s| s.is_nan()) {
            return Err(format!("`tokenizer.ggml.scores` is NaN for token {id}"));
        }
        first_seen_last_scored(spelled, |id| f64::from(scores[id]))
    };
    Ok(generate_merges(&keys, vocab))
}

/// The normalizer, pre-tokenizer and decoder of a flavour.
fn pipeline(
    flavor: SpmFlavor,
) -> Result<(Option<NormalizerWrapper>, Option<PreTokenizerWrapper>, DecoderWrapper), String> {
    let space = SPACE.to_string();
    let replace = |from: &str, to: &str| {
        Replace::new(from, to).map_err(|e| format!("the `{from}` replacement does not build: {e}"))
    };
    let mut decoders = vec![
        DecoderWrapper::Replace(replace(&space, " ")?),
        DecoderWrapper::ByteFallback(ByteFallback::new()),
        DecoderWrapper::Fuse(Fuse::new()),
    ];
    if flavor.strips_leading_space() {
        decoders.push(DecoderWrapper::Strip(Strip::new(' ', 1, 0)));
    }
    let decoder = DecoderWrapper::Sequence(DecoderSequence::new(decoders));
    Ok(match flavor {
        SpmFlavor::Llama { prefix_space } => {
            let scheme = if prefix_space {
                PrependScheme::First
            } else {
                PrependScheme::Never
            };
            (
                None,
                Some(PreTokenizerWrapper::Metaspace(Metaspace::new(SPACE, scheme, false))),
                decoder,
            )
        }
        SpmFlavor::Gemma => {
            // The split on " " never matches after the normalizer; kept
            // because it is what transformers builds (and serializes).
            let split = Split::new(
                SplitPattern::String(" ".into()),
                SplitDelimiterBehavior::MergedWithPrevious,
                false,
            )
            .map_err(|e| format!("the space split does not build: {e}"))?;
            (
                Some(NormalizerWrapper::Replace(replace(" ", &space)?)),
                Some(PreTokenizerWrapper::Split(split)),
                decoder,
            )
        }
        SpmFlavor::Phi3 => {
            let steps = vec![
                NormalizerWrapper::Prepend(Prepend::new(space.clone())),
                NormalizerWrapper::Replace(replace(" ", &space)?),
            ];
            (
                Some(NormalizerWrapper::Sequence(NormalizerSequence::new(steps))),
                None,
                decoder,
            )
        }
    })
}

/// The tokenizer a SentencePiece-style vocabulary describes; an error
/// (to be put in the file's context) naming what is wrong.
pub fn build(v: &SpmVocabulary, flavor: SpmFlavor) -> Result<SpmTokenizer, String> {
    if v.types.len() != v.tokens.len() {
        return Err(format!(
            "`tokenizer.ggml.token_type` has {} entries for {} tokens",
            v.types.len(),
            v.tokens.len()
        ));
    }
    let spelled: Vec<String> = match flavor {
        SpmFlavor::Gemma => v.tokens.iter().map(|t| gemma_spelling(t)).collect(),
        _ => v.tokens.to_vec(),
    };
    // A repeated token takes its last id, as in the converter's dict.
    let vocab: Vocab = spelled
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let merges = merges(v, flavor, &spelled, &vocab)?;
    let mut bpe = BPE::builder()
        .vocab_and_merges(vocab.clone(), merges)
        .byte_fallback(true)
        .fuse_unk(true);
    if flavor == SpmFlavor::Gemma {
        // GemmaTokenizer's own; the Llama flavour has none.
        bpe = bpe.unk_token("<unk>".into());
    }
    let bpe = bpe.build().map_err(|e| format!("the BPE model does not build: {e}"))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let (normalizer, pre_tokenizer, decoder) = pipeline(flavor)?;
    inner.with_normalizer(normalizer);
    inner.with_pre_tokenizer(pre_tokenizer);
    inner.with_decoder(Some(decoder));

    let mut special = vec![false; v.tokens.len()];
    for (id, &ty) in v.types.iter().enumerate() {
        special[id] = ty == TOKEN_TYPE_CONTROL;
    }
    for &id in v.named_special {
        if let Some(flag) = special.get_mut(id as usize) {
            *flag = true;
        }
    }
    // Special tokens as the file spells them (a Gemma control token is
    // never a run of spaces); user-defined ones only where that spelling is
    // in the vocabulary, so Gemma's space runs stay BPE pieces.
    let control: Vec<AddedToken> = v
        .tokens
        .iter()
        .zip(&special)
        .filter(|(_, &s)| s)
        .map(|(t, _)| AddedToken::from(t.clone(), true).normalized(false))
        .collect();
    let user: Vec<AddedToken> = v
        .tokens
        .iter()
        .zip(v.types)
        .filter(|(t, &ty)| ty == TOKEN_TYPE_USER_DEFINED && vocab.contains_key(t.as_str()))
        .map(|(t, _)| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    inner.add_special_tokens(&control);
    inner.add_tokens(&user);
    let token_bytes = v.tokens.iter().map(|t| Some(token_bytes(t))).collect();
    Ok(SpmTokenizer {
        inner,
        token_bytes,
        special,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_tokens_and_spaces_decode_as_the_converter_decodes() {
        assert_eq!(&*token_bytes("<0x0A>"), b"\n");
        assert_eq!(&*token_bytes("<0xff>"), &[0xFF]);
        assert_eq!(&*token_bytes("<0xZZ>"), b"<0xZZ>");
        assert_eq!(&*token_bytes("\u{2581}the\u{2581}"), b" the ");
        assert_eq!(gemma_spelling("   "), "\u{2581}\u{2581}\u{2581}");
        assert_eq!(gemma_spelling(" \u{1c}"), "\u{2581}\u{2581}");
        assert_eq!(gemma_spelling("\n\n"), "\n\n");
        assert_eq!(gemma_spelling(" a"), " a");
    }

    #[test]
    fn merges_come_best_score_first_then_longer_left_then_vocabulary_order() {
        let tokens: Vec<String> = ["a", "b", "c", "ab", "bc", "abc", "ca"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let scores = [0.0, 0.0, 0.0, -1.0, -2.0, -1.0, -3.0];
        let vocab: Vocab = tokens.iter().enumerate().map(|(i, t)| (t.clone(), i as u32)).collect();
        let keys = first_seen_last_scored(&tokens, |id| scores[id]);
        let got = generate_merges(&keys, &vocab);
        let pairs: Vec<(&str, &str)> = got.iter().map(|(a, b)| (a.as_str(), b.as_str())).collect();
        // Score -1 ("ab" and "abc"): ab+c (left 2), then a+bc (left 1,
        // right 2), then a+b (1, 1), though "ab" comes first in the
        // vocabulary; then score -2, then -3.
        assert_eq!(pairs, [("ab", "c"), ("a", "bc"), ("a", "b"), ("b", "c"), ("c", "a")]);
    }

    #[test]
    fn a_repeated_token_keeps_its_first_place_and_last_score() {
        let tokens: Vec<String> = ["x", "y", "x"].iter().map(|s| s.to_string()).collect();
        let keys = first_seen_last_scored(&tokens, |id| id as f64);
        assert_eq!(keys, [("x", 2.0), ("y", 1.0)]);
    }
}
