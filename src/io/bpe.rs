//! A pretrained model's own BPE tokenizer, built by Hugging Face's
//! `tokenizers` crate from a GGUF file's metadata (byte-level,
//! `tokenizer.ggml.model = gpt2`, or SentencePiece-style, `llama`: see
//! [`crate::io::spm`]) or read from a `tokenizer.json`, with streamed
//! decoding that never splits a UTF-8 character.
//!
//! From GGUF: the vocabulary (`tokenizer.ggml.tokens`, spelled in GPT-2's
//! byte-to-unicode alphabet), the merges (`"a b"`, best first), the token
//! types (3 control, 4 user-defined: both matched whole in the text, never
//! split), the pre-tokenizer named by `tokenizer.ggml.pre` (the regexes
//! llama.cpp's `llama-vocab.cpp` lists for that name), the bos/eos ids and
//! `tokenizer.ggml.add_bos_token`. Where llama.cpp and transformers'
//! GGUF converter differ (a control token spelled outside the byte
//! alphabet, a repeated token), this follows the converter, which agrees
//! with llama.cpp on every token SmolLM2 has.

use std::collections::HashMap;
use std::path::Path;

use tokenizers::decoders::DecoderWrapper;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior};

use crate::error::{Error, Result};
use crate::io::gguf::{Array, Gguf};
use crate::io::hf_folder::ExtraFile;
use crate::io::spm::{self, SpmFlavor, SpmTokenizer, SpmVocabulary};
use crate::io::text::Utf8Stream;

/// GPT-2's pre-tokenizer split (`encoder.py`), which llama.cpp's BPE
/// vocabularies share or extend.
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";
/// Llama 3's (tiktoken's cl100k): numbers in groups of up to three.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2's: Llama 3's with every digit alone.
const QWEN2_SPLIT: &str =
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Mistral's Tekken (Nemo, Small 3): cased words, every digit alone, as
/// transformers' GGUF converter splits it.
const TEKKEN_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*",
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);
/// GPT-4o's (o200k; Llama 4): cased words with contractions, numbers in
/// threes.
const GPT4O_SPLIT: &str = concat!(
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
);

/// `tokenizer.ggml.pre` names and the splits they apply in order, as
/// llama.cpp's `llama-vocab.cpp` and transformers' GGUF converter give them
/// (SmolLM2's `smollm`: each digit alone, then GPT-2's split; Qwen2, Qwen2.5
/// and Qwen3 files say `qwen2`).
const PRE_TOKENIZERS: &[(&[&str], &[&str])] = &[
    (
        &["gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"],
        &[GPT2_SPLIT],
    ),
    (
        &[
            "smollm",
            "starcoder",
            "refact",
            "command-r",
            "codeshell",
            "exaone",
            "minerva-7b",
        ],
        &[r"\p{N}", GPT2_SPLIT],
    ),
    (
        &[
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "dbrx",
            "smaug-bpe",
            "lfm2",
            "midm-2.0",
        ],
        &[LLAMA3_SPLIT],
    ),
    (
        &["qwen2", "stablelm2", "deepseek-r1-qwen", "megrez", "kormo", "f2llmv2"],
        &[QWEN2_SPLIT],
    ),
    (&["tekken"], &[TEKKEN_SPLIT]),
    (&["gpt-4o", "llama4", "minimax-m2"], &[GPT4O_SPLIT]),
];

/// llama.cpp's token types that are matched whole in the text.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// A BPE tokenizer of a pretrained model: byte-level, or SentencePiece-style
/// with byte fallback. SmolLM2's (`smollm`), a Qwen 2 vocabulary (`qwen2`),
/// Gemma 3's and Llama-style SentencePiece vocabularies are checked id for
/// id against transformers' (tests/suite/tokenizer.rs); the other `pre`
/// names share the byte-level code and differ only in their split, which
/// the tests check on its own.
#[derive(Clone)]
pub struct BpeTokenizer {
    inner: tokenizers::Tokenizer,
    /// The bytes each id decodes to (`None` for an id the vocabulary skips).
    token_bytes: Vec<Option<Box<[u8]>>>,
    /// Control tokens, which `decode(…, skip_special = true)` leaves out.
    special: Vec<bool>,
    bos: Option<u32>,
    eos: Option<u32>,
    /// BOS put before the text by [`BpeTokenizer::encode`] with
    /// `add_special` (GGUF's `add_bos_token`; a tokenizer.json does this in
    /// its own post-processor).
    prepend_bos: Option<u32>,
    chat_template: Option<String>,
    /// Whether [`BpeTokenizer::decode`] drops one leading space: the one a
    /// SentencePiece-style vocabulary put before the text (transformers'
    /// `Strip` decoder). A stream keeps it: generated text continues a
    /// prompt.
    strip_leading_space: bool,
}

impl std::fmt::Debug for BpeTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BpeTokenizer({} tokens, bos {:?}, eos {:?})",
            self.token_bytes.len(),
            self.bos,
            self.eos
        )
    }
}

/// GPT-2's map from bytes to the printable characters byte-level
/// vocabularies are spelled in (`bytes_to_unicode` in its `encoder.py`;
/// the `tokenizers` crate keeps its copy private).
fn byte_alphabet() -> [char; 256] {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
    let mut map = ['\0'; 256];
    let mut next_unprintable = 256u32;
    for b in 0..=255u8 {
        map[b as usize] = if printable(b) {
            char::from(b)
        } else {
            next_unprintable += 1;
            // 256 + n for the n-th unprintable byte: always a valid char.
            char::from_u32(next_unprintable - 1).unwrap_or(char::REPLACEMENT_CHARACTER)
        };
    }
    map
}

/// What the ByteLevel decoder turns one token into: its characters mapped
/// back to bytes, or, when one is outside the alphabet (an added token),
/// the token's own UTF-8.
fn token_to_bytes(token: &str, char_to_byte: &HashMap<char, u8>) -> Box<[u8]> {
    token
        .chars()
        .map(|c| char_to_byte.get(&c).copied())
        .collect::<Option<Vec<u8>>>()
        .unwrap_or_else(|| token.as_bytes().to_vec())
        .into_boxed_slice()
}

/// The pre-tokenizer for a `tokenizer.ggml.pre` name: its splits, each
/// match kept as its own piece, then the byte-to-alphabet mapping.
fn pre_tokenizer(pre: &str) -> std::result::Result<PreTokenizerWrapper, String> {
    let Some((_, splits)) = PRE_TOKENIZERS.iter().find(|(names, _)| names.contains(&pre)) else {
        let known: Vec<&str> = PRE_TOKENIZERS
            .iter()
            .flat_map(|(names, _)| names.iter().copied())
            .collect();
        return Err(format!(
            "the pre-tokenizer `{pre}` is not one wgrad knows ({})",
            known.join(", ")
        ));
    };
    let mut steps = Vec::with_capacity(splits.len() + 1);
    for regex in *splits {
        let split = Split::new(
            SplitPattern::Regex((*regex).to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| format!("the split regex of `{pre}` does not compile: {e}"))?;
        steps.push(PreTokenizerWrapper::Split(split));
    }
    steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, false)));
    Ok(PreTokenizerWrapper::Sequence(Sequence::new(steps)))
}

impl BpeTokenizer {
    /// The tokenizer a GGUF file describes: byte-level BPE
    /// (`tokenizer.ggml.model = gpt2`) or a SentencePiece-style vocabulary
    /// (`llama`, see [`crate::io::spm`]). A file without one, with another
    /// tokenizer model, an unknown pre-tokenizer, merges that name tokens
    /// the vocabulary lacks, or special ids outside the vocabulary is an
    /// error naming what is wrong.
    pub fn from_gguf(gguf: &Gguf) -> Result<Self> {
        let bad = |reason: String| Error::Gguf {
            path: gguf.path().to_path_buf(),
            reason,
        };
        let model = gguf.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" && model != "llama" {
            return Err(bad(format!(
                "the tokenizer model `{model}` is not one wgrad runs \
                 (it runs byte-level BPE, `gpt2`, and SentencePiece-style BPE, `llama`)"
            )));
        }
        let tokens = gguf.get_strings("tokenizer.ggml.tokens")?;
        if tokens.is_empty() {
            return Err(bad("`tokenizer.ggml.tokens` is empty".into()));
        }
        let types = match gguf.get("tokenizer.ggml.token_type") {
            None => vec![1; tokens.len()],
            Some(_) => token_types(gguf.get_array("tokenizer.ggml.token_type")?)
                .ok_or_else(|| bad("`tokenizer.ggml.token_type` is not an array of integers".into()))?,
        };
        if types.len() != tokens.len() {
            return Err(bad(format!(
                "`tokenizer.ggml.token_type` has {} entries for {} tokens",
                types.len(),
                tokens.len()
            )));
        }
        let special_id = |key: &str| -> Result<Option<u32>> {
            let Some(_) = gguf.get(key) else { return Ok(None) };
            let id = gguf.get_u64(key)?;
            match u32::try_from(id) {
                Ok(id) if (id as usize) < tokens.len() => Ok(Some(id)),
                _ => Err(bad(format!(
                    "`{key}` is {id}, outside the vocabulary of {} tokens",
                    tokens.len()
                ))),
            }
        };
        let bos = special_id("tokenizer.ggml.bos_token_id")?;
        let eos = special_id("tokenizer.ggml.eos_token_id")?;
        let pad = special_id("tokenizer.ggml.padding_token_id")?;
        let unk = special_id("tokenizer.ggml.unknown_token_id")?;
        // llama.cpp and transformers put BOS first in a SentencePiece file
        // that does not say otherwise.
        let add_bos = match gguf.get("tokenizer.ggml.add_bos_token") {
            Some(_) => gguf.get_bool("tokenizer.ggml.add_bos_token")?,
            None => model == "llama",
        };
        let prepend_bos = match (add_bos, bos) {
            (true, None) => {
                return Err(bad(
                    "`tokenizer.ggml.add_bos_token` is set but the file has no `tokenizer.ggml.bos_token_id`".into(),
                ))
            }
            (true, bos) => bos,
            (false, _) => None,
        };
        let chat_template = match gguf.get("tokenizer.chat_template") {
            Some(_) => Some(gguf.get_str("tokenizer.chat_template")?.to_string()),
            None => None,
        };
        let (inner, token_bytes, special, strip_leading_space) = if model == "gpt2" {
            let (inner, token_bytes, special) = byte_level_from_gguf(gguf, tokens, &types)?;
            (inner, token_bytes, special, false)
        } else {
            let named: Vec<u32> = [bos, eos, unk, pad].into_iter().flatten().collect();
            let (built, flavor) = sentencepiece_from_gguf(gguf, tokens, &types, &named)?;
            (
                built.inner,
                built.token_bytes,
                built.special,
                flavor.strips_leading_space(),
            )
        };
        Ok(BpeTokenizer {
            inner,
            token_bytes,
            special,
            bos,
            eos,
            prepend_bos,
            chat_template,
            strip_leading_space,
        })
    }

    /// A Hugging Face `tokenizer.json` whose decoder is byte-level (GPT-2,
    /// SmolLM2, Llama 3, Qwen …) or SentencePiece-style (Llama 2, Mistral,
    /// Gemma: `▁` for spaces, byte fallback). Its special tokens, bos and eos come from
    /// the file's added tokens; [`BpeTokenizer::from_folder`] also reads
    /// `tokenizer_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|source| Error::DataIo {
            op: "BpeTokenizer::from_file",
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |reason: String| Error::DataFormat {
            op: "BpeTokenizer::from_file",
            file: path.display().to_string(),
            reason,
        };
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| bad(format!("not a tokenizer.json wgrad can read: {e}")))?;
        // Byte-level, or SentencePiece-style (`▁` for spaces, byte fallback),
        // whose decoder may strip the prefix space.
        const RUNS: &str = "wgrad runs byte-level BPE tokenizers (decoder `ByteLevel`) and SentencePiece-style ones \
                            (decoders Replace `▁`, ByteFallback, Fuse and perhaps Strip)";
        let sentencepiece = match inner.get_decoder() {
            Some(DecoderWrapper::ByteLevel(_)) => None,
            Some(other) => {
                let json = serde_json::to_value(other).ok();
                match json.as_ref().and_then(spm::decoder_strips) {
                    Some(strips) => Some(strips),
                    None => {
                        let name = json
                            .as_ref()
                            .and_then(|v| v.get("type").and_then(|t| t.as_str()))
                            .unwrap_or("unknown");
                        return Err(bad(format!("its decoder is `{name}`; {RUNS}")));
                    }
                }
            }
            None => return Err(bad(format!("it has no decoder; {RUNS}"))),
        };
        let size = inner.get_vocab_size(true);
        let char_to_byte: HashMap<char, u8> = byte_alphabet().iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
        let bytes_of = |t: String| match sentencepiece {
            Some(_) => spm::token_bytes(&t),
            None => token_to_bytes(&t, &char_to_byte),
        };
        let token_bytes = (0..size as u32).map(|id| inner.id_to_token(id).map(bytes_of)).collect();
        let mut special = vec![false; size];
        for (&id, token) in inner.get_added_tokens_decoder().iter() {
            if token.special {
                if let Some(flag) = special.get_mut(id as usize) {
                    *flag = true;
                }
            }
        }
        let strip_leading_space = sentencepiece.unwrap_or(false);
        let (bos, eos, prepend_bos, chat_template) = (None, None, None, None);
        Ok(BpeTokenizer {
            inner,
            token_bytes,
            special,
            bos,
            eos,
            prepend_bos,
            chat_template,
            strip_leading_space,
        })
    }

    /// The tokenizer of a Hugging Face model folder: `tokenizer.json`, with
    /// the chat template, bos and eos of `tokenizer_config.json` when it has
    /// them. `None` when the folder has no `tokenizer.json`.
    pub fn from_folder(dir: impl AsRef<Path>) -> Result<Option<Self>> {
        let dir = dir.as_ref();
        let file = dir.join("tokenizer.json");
        if !file.is_file() {
            return Ok(None);
        }
        let mut tokenizer = Self::from_file(&file)?;
        let config_path = dir.join("tokenizer_config.json");
        if config_path.is_file() {
            tokenizer.apply_config(&config_path)?;
        }
        Ok(Some(tokenizer))
    }

    /// bos, eos and the chat template from a `tokenizer_config.json`.
    fn apply_config(&mut self, path: &Path) -> Result<()> {
        let op = "BpeTokenizer::from_folder";
        let bytes = std::fs::read(path).map_err(|source| Error::DataIo {
            op,
            path: path.to_path_buf(),
            source,
        })?;
        let bad = |reason: String| Error::DataFormat {
            op,
            file: path.display().to_string(),
            reason,
        };
        let config: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
        // A token is a string or an AddedToken object with `content`.
        let token_id = |key: &str| -> Result<Option<u32>> {
            let content = match config.get(key) {
                None | Some(serde_json::Value::Null) => return Ok(None),
                Some(serde_json::Value::String(s)) => s.as_str(),
                Some(v) => v
                    .get("content")
                    .and_then(|c| c.as_str())
                    .ok_or_else(|| bad(format!("`{key}` is neither a string nor a token with `content`")))?,
            };
            self.inner.token_to_id(content).map(Some).ok_or_else(|| {
                bad(format!(
                    "`{key}` is `{content}`, which is not in tokenizer.json's vocabulary"
                ))
            })
        };
        self.bos = token_id("bos_token")?;
        self.eos = token_id("eos_token")?;
        // One template, or a list of named ones of which `default` is used.
        self.chat_template = match config.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .and_then(|t| t.get("template").and_then(|s| s.as_str()))
                .map(str::to_string),
            Some(_) => {
                return Err(bad(
                    "`chat_template` is neither a string nor a list of named templates".into()
                ))
            }
        };
        Ok(())
    }

    /// Ids a model with this tokenizer may produce: the vocabulary and the
    /// added tokens.
    pub fn vocab_size(&self) -> usize {
        self.token_bytes.len()
    }

    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// BOS as text, for a chat template's `bos_token`.
    pub fn bos_token(&self) -> Option<String> {
        self.bos.and_then(|id| self.token(id))
    }

    /// EOS as text, for a chat template's `eos_token`.
    pub fn eos_token(&self) -> Option<String> {
        self.eos.and_then(|id| self.token(id))
    }

    /// The id of a token spelled exactly `token` (`<|im_end|>`), if any.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The text of token `id` as the vocabulary spells it (`<|im_end|>`,
    /// `Ġthe`).
    pub fn token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The Jinja chat template the model came with
    /// (`tokenizer.chat_template`), if any; see [`crate::io::chat`].
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Whether `id` is a control token (`<|im_start|>`, `<|endoftext|>`).
    pub fn is_special(&self, id: u32) -> bool {
        self.special.get(id as usize).copied().unwrap_or(false)
    }

    /// Token ids of `text`. Special tokens written in the text
    /// (`<|im_start|>`) become their ids, as a rendered chat template needs;
    /// `add_special` puts BOS first when the model asks for it (false for a
    /// rendered template, which writes its own, as transformers does).
    pub fn encode(&self, text: &str, add_special: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special)
            .map_err(|e| Error::InvalidArgument {
                op: "BpeTokenizer::encode",
                reason: e.to_string(),
            })?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if let (true, Some(bos)) = (add_special, self.prepend_bos) {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// The BOS id [`BpeTokenizer::encode`] puts first with `add_special`
    /// (a GGUF file's `add_bos_token`, a folder's post-processor), or None
    /// when it puts none: what a scorer puts at the start of each window,
    /// as llama.cpp's perplexity does.
    pub fn leading_bos(&self) -> Option<u32> {
        let bos = self.bos?;
        let ids = self.encode("", true).ok()?;
        (ids.first() == Some(&bos)).then_some(bos)
    }

    /// The bytes of token `id`; an id outside the vocabulary is an error.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        match self.token_bytes.get(id as usize) {
            Some(Some(bytes)) => Ok(bytes),
            _ => Err(Error::InvalidArgument {
                op: "BpeTokenizer::decode",
                reason: format!(
                    "id {id} is not a token of this vocabulary of {}",
                    self.token_bytes.len()
                ),
            }),
        }
    }

    /// The bytes of `ids`, control tokens left out when `skip_special`.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &id in ids {
            let token = self.token_bytes(id)?;
            if !(skip_special && self.is_special(id)) {
                bytes.extend_from_slice(token);
            }
        }
        Ok(bytes)
    }

    /// The text of `ids`; bytes that are not whole UTF-8 characters become
    /// U+FFFD. A SentencePiece-style vocabulary that puts a space before
    /// the text drops one leading space, as transformers' decoder does.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        let text = match (self.strip_leading_space, bytes.split_first()) {
            (true, Some((b' ', rest))) => rest,
            _ => &bytes[..],
        };
        Ok(String::from_utf8_lossy(text).into_owned())
    }

    /// The Hugging Face files of this tokenizer, for a model folder that
    /// `transformers` loads (`AutoTokenizer`, `generate`): `tokenizer.json`
    /// (what this tokenizer encodes with, plus a post-processor putting BOS
    /// first where [`BpeTokenizer::encode`] does), `tokenizer_config.json`
    /// (a plain `PreTrainedTokenizerFast`, so no class adds tokens of its
    /// own; bos, eos, the chat template) and `generation_config.json`.
    pub fn hugging_face_files(&self) -> Result<Vec<ExtraFile>> {
        let bad = |reason: String| Error::InvalidArgument {
            op: "BpeTokenizer::hugging_face_files",
            reason,
        };
        let mut inner = self.inner.clone();
        if let Some(bos) = self.prepend_bos {
            let token = self
                .token(bos)
                .ok_or_else(|| bad(format!("BOS id {bos} has no token")))?;
            let template = TemplateProcessing::builder()
                .try_single(format!("{token} $A"))
                .and_then(|b| b.try_pair(format!("{token} $A {token} $B:1")))
                .map_err(|e| bad(format!("the BOS template does not build: {e}")))?
                .special_tokens(vec![(token.clone(), bos)])
                .build()
                .map_err(|e| bad(format!("the BOS template does not build: {e}")))?;
            inner.with_post_processor(Some(template));
        }
        let tokenizer_json = inner
            .to_string(true)
            .map_err(|e| bad(format!("tokenizer.json does not serialize: {e}")))?;
        let mut config = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": false,
            "add_bos_token": self.prepend_bos.is_some(),
        });
        let mut generation = serde_json::json!({});
        for (key, id) in [("bos", self.bos), ("eos", self.eos)] {
            if let Some(id) = id {
                config[format!("{key}_token")] = self.token(id).into();
                generation[format!("{key}_token_id")] = id.into();
            }
        }
        if let Some(template) = &self.chat_template {
            config["chat_template"] = template.clone().into();
        }
        let pretty = |v: &serde_json::Value| serde_json::to_vec_pretty(v).map_err(|e| bad(e.to_string()));
        Ok(vec![
            ("tokenizer.json".into(), tokenizer_json.into_bytes()),
            ("tokenizer_config.json".into(), pretty(&config)?),
            ("generation_config.json".into(), pretty(&generation)?),
        ])
    }

    /// A decoder fed one id at a time, for streaming generated text.
    pub fn stream(&self, skip_special: bool) -> TokenStream<'_> {
        TokenStream {
            tokenizer: self,
            text: Utf8Stream::default(),
            skip_special,
        }
    }

    /// The text `id` completes in `text` (empty while a character is
    /// incomplete, or for a control token with `skip_special`): one step of
    /// a [`TokenStream`], for a decoder that outlives a borrow of the
    /// tokenizer (a server's response stream).
    pub fn decode_next(&self, text: &mut Utf8Stream, id: u32, skip_special: bool) -> Result<String> {
        let token = self.token_bytes(id)?;
        if skip_special && self.is_special(id) {
            return Ok(String::new());
        }
        Ok(text.push(token))
    }
}

/// A `gpt2` file's byte-level BPE: the pre-tokenizer its `pre` names, the
/// merges, the control and user-defined tokens; with each id's bytes and
/// whether it is special.
fn byte_level_from_gguf(gguf: &Gguf, tokens: &[String], types: &[i64]) -> Result<ByteLevelParts> {
    let bad = |reason: String| Error::Gguf {
        path: gguf.path().to_path_buf(),
        reason,
    };
    let pre = match gguf.get("tokenizer.ggml.pre") {
        Some(_) => gguf.get_str("tokenizer.ggml.pre")?,
        None => {
            return Err(bad(
                "has no `tokenizer.ggml.pre`, so the pre-tokenizer split is unknown".into(),
            ))
        }
    };
    let pre_tokenizer = pre_tokenizer(pre).map_err(bad)?;
    let merges = gguf.get_strings("tokenizer.ggml.merges")?;
    let alphabet = byte_alphabet();
    let char_to_byte: HashMap<char, u8> = alphabet.iter().enumerate().map(|(b, &c)| (c, b as u8)).collect();
    let in_alphabet = |t: &str| t.chars().all(|c| char_to_byte.contains_key(&c));
    // A token spelled outside the alphabet is respelled from its UTF-8
    // bytes (transformers' converter does the same); a repeated token
    // takes its last id, as in llama.cpp and the converter.
    let respell = |t: &String| {
        if in_alphabet(t) {
            t.clone()
        } else {
            t.bytes().map(|b| alphabet[b as usize]).collect()
        }
    };
    let spelled: Vec<String> = tokens.iter().map(respell).collect();
    let vocab: tokenizers::models::bpe::Vocab = spelled
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), id as u32))
        .collect();
    let mut merge_pairs = Vec::with_capacity(merges.len());
    for (i, merge) in merges.iter().enumerate() {
        let Some((a, b)) = merge.split_once(' ') else {
            return Err(bad(format!(
                "merge {i} `{merge}` is not two tokens separated by a space"
            )));
        };
        for part in [a, b] {
            if !vocab.contains_key(part) {
                return Err(bad(format!(
                    "merge {i} `{merge}` names `{part}`, which is not in the vocabulary"
                )));
            }
        }
        if !vocab.contains_key(&format!("{a}{b}")) {
            return Err(bad(format!(
                "merge {i} `{merge}` makes `{a}{b}`, which is not in the vocabulary"
            )));
        }
        merge_pairs.push((a.to_string(), b.to_string()));
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merge_pairs)
        .build()
        .map_err(|e| bad(format!("the BPE model does not build: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    inner.with_pre_tokenizer(Some(pre_tokenizer));
    inner.with_decoder(Some(DecoderWrapper::ByteLevel(ByteLevel::new(false, true, false))));
    // Control tokens outside the alphabet are skipped, as the converter
    // does: adding one would give it an id past the model's vocabulary.
    let control: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(t, &ty)| ty == TOKEN_TYPE_CONTROL && in_alphabet(t))
        .map(|(t, _)| AddedToken::from(t.clone(), true))
        .collect();
    let user: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(t, &ty)| ty == TOKEN_TYPE_USER_DEFINED && in_alphabet(t))
        .map(|(t, _)| AddedToken::from(t.clone(), false).normalized(false))
        .collect();
    inner.add_special_tokens(&control);
    inner.add_tokens(&user);

    let token_bytes = spelled.iter().map(|t| Some(token_to_bytes(t, &char_to_byte))).collect();
    let special = tokens
        .iter()
        .zip(types)
        .map(|(t, &ty)| ty == TOKEN_TYPE_CONTROL && in_alphabet(t))
        .collect();
    Ok((inner, token_bytes, special))
}

/// A `llama` file's SentencePiece-style vocabulary (scores, or listed
/// merges), in the flavour its architecture names.
fn sentencepiece_from_gguf(
    gguf: &Gguf,
    tokens: &[String],
    types: &[i64],
    named: &[u32],
) -> Result<(SpmTokenizer, SpmFlavor)> {
    let bad = |reason: String| Error::Gguf {
        path: gguf.path().to_path_buf(),
        reason,
    };
    let architecture = match gguf.get("general.architecture") {
        Some(_) => gguf.get_str("general.architecture")?,
        None => "llama",
    };
    let add_space_prefix = match gguf.get("tokenizer.ggml.add_space_prefix") {
        Some(_) => Some(gguf.get_bool("tokenizer.ggml.add_space_prefix")?),
        None => None,
    };
    let scores = match gguf.get("tokenizer.ggml.scores") {
        None => None,
        Some(_) => match gguf.get_array("tokenizer.ggml.scores")? {
            Array::F32(scores) => Some(scores.as_slice()),
            _ => return Err(bad("`tokenizer.ggml.scores` is not an array of f32".into())),
        },
    };
    let merges = match gguf.get("tokenizer.ggml.merges") {
        Some(_) => Some(gguf.get_strings("tokenizer.ggml.merges")?),
        None => None,
    };
    let flavor = SpmFlavor::for_architecture(architecture, add_space_prefix);
    let vocabulary = SpmVocabulary {
        tokens,
        scores,
        merges,
        types,
        named_special: named,
    };
    Ok((spm::build(&vocabulary, flavor).map_err(bad)?, flavor))
}

/// The byte-level model, each id's bytes, and which ids are special.
type ByteLevelParts = (tokenizers::Tokenizer, Vec<Option<Box<[u8]>>>, Vec<bool>);

/// Token types as integers, whatever integer type the file used.
fn token_types(array: &Array) -> Option<Vec<i64>> {
    Some(match array {
        Array::I32(v) => v.iter().map(|&t| i64::from(t)).collect(),
        Array::U32(v) => v.iter().map(|&t| i64::from(t)).collect(),
        Array::I8(v) => v.iter().map(|&t| i64::from(t)).collect(),
        Array::U8(v) => v.iter().map(|&t| i64::from(t)).collect(),
        Array::I16(v) => v.iter().map(|&t| i64::from(t)).collect(),
        Array::U16(v) => v.iter().map(|&t| i64::from(t)).collect(),
        Array::I64(v) => v.clone(),
        _ => return None,
    })
}

/// Generated ids in, text out as soon as its characters are whole: a
/// byte-level token can end inside a multi-byte character (an emoji is
/// often two or three tokens).
pub struct TokenStream<'t> {
    tokenizer: &'t BpeTokenizer,
    text: Utf8Stream,
    skip_special: bool,
}

impl TokenStream<'_> {
    /// The text `id` completes (empty while a character is incomplete).
    pub fn push(&mut self, id: u32) -> Result<String> {
        self.tokenizer.decode_next(&mut self.text, id, self.skip_special)
    }

    /// What is left at the end (an incomplete character as U+FFFD).
    pub fn finish(&mut self) -> String {
        self.text.finish()
    }
}
