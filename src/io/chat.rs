//! Chat templates: the Jinja template a model ships
//! (`tokenizer.chat_template` in GGUF, `chat_template` in
//! `tokenizer_config.json`) rendered by `minijinja` the way transformers'
//! `apply_chat_template` renders it: `trim_blocks` and `lstrip_blocks`,
//! `{% break %}`/`{% continue %}`, Python's string methods (`.strip()`,
//! `.startswith()` …), `tojson`, and `raise_exception(message)`, which a
//! template calls to refuse a conversation.

use crate::error::{Error, Result};

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (a template may accept others).
    pub role: String,
    pub content: String,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }

    pub fn system(content: impl Into<String>) -> Self {
        Self::new("system", content)
    }

    pub fn user(content: impl Into<String>) -> Self {
        Self::new("user", content)
    }

    pub fn assistant(content: impl Into<String>) -> Self {
        Self::new("assistant", content)
    }
}

/// The template's name inside its environment.
const TEMPLATE_NAME: &str = "chat_template";

/// Instructions one render may run. The template comes with the model
/// file: one that loops without end (nested `range`s) stops with an error
/// instead of hanging. SmolLM2's takes about 40 a message.
const RENDER_FUEL: u64 = 1 << 22;

/// The output a render may write beyond 8 times its inputs (messages and
/// special tokens), so a looping template cannot fill memory either.
const PROMPT_SLACK_BYTES: usize = 1 << 20;

/// A render's output, refused past `limit` bytes.
struct CappedOutput {
    bytes: Vec<u8>,
    limit: usize,
}

impl std::io::Write for CappedOutput {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.bytes.len().saturating_add(buf.len()) > self.limit {
            return Err(std::io::Error::other(format!(
                "the prompt grows past {} bytes",
                self.limit
            )));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A chat template parsed once, rendered for every turn.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ChatTemplate")
    }
}

fn template_error(op: &'static str, e: &minijinja::Error) -> Error {
    // `display_debug_info` adds the template's lines around the error.
    let mut reason = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        reason.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    Error::InvalidArgument { op, reason }
}

impl ChatTemplate {
    /// Parses `source`; a syntax error names its line.
    pub fn new(source: &str) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        // transformers renders with both on: a block tag's own line adds
        // no whitespace.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| template_error("ChatTemplate::new", &e))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(RENDER_FUEL));
        env.add_function(
            "raise_exception",
            |message: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| template_error("ChatTemplate::new", &e))?;
        Ok(ChatTemplate { env })
    }

    /// The prompt for `messages`; with `add_generation_prompt` it ends
    /// where the assistant's answer begins. A template that raises
    /// (`raise_exception`, a bad operation) is an error with its message.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        bos_token: &str,
        eos_token: &str,
    ) -> Result<String> {
        let op = "ChatTemplate::render";
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| template_error(op, &e))?;
        let context = minijinja::context! {
            messages => messages
                .iter()
                .map(|m| minijinja::Value::from_pairs([("role", m.role.as_str()), ("content", m.content.as_str())]))
                .collect::<minijinja::Value>(),
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        let inputs =
            messages.iter().map(|m| m.role.len() + m.content.len()).sum::<usize>() + bos_token.len() + eos_token.len();
        let mut out = CappedOutput {
            bytes: Vec::new(),
            limit: inputs.saturating_mul(8).saturating_add(PROMPT_SLACK_BYTES),
        };
        template
            .render_captured_to(context, &mut out)
            .map_err(|e| template_error(op, &e))?;
        String::from_utf8(out.bytes).map_err(|e| Error::InvalidArgument {
            op,
            reason: format!("the rendered prompt is not UTF-8: {e}"),
        })
    }
}

/// Parses and renders `template` once ([`ChatTemplate`] keeps it parsed).
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    ChatTemplate::new(template)?.render(messages, add_generation_prompt, bos_token, eos_token)
}

/// Tokens that end an assistant's turn besides the tokenizer's EOS, where
/// a vocabulary has them: ChatML's (SmolLM2, Qwen), Llama 3's, Phi's and
/// Gemma's. Templates end a turn with one of these rather than with EOS,
/// so generation that stops only at EOS would run on into a next turn.
pub const END_OF_TURN: [&str; 4] = ["<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>"];

/// The ids that end a turn for `tokenizer`: its EOS, then each of
/// [`END_OF_TURN`] its vocabulary has, each once.
pub fn stop_ids(tokenizer: &crate::io::bpe::BpeTokenizer) -> Vec<u32> {
    let mut stops: Vec<u32> = tokenizer
        .eos_id()
        .into_iter()
        .chain(END_OF_TURN.iter().filter_map(|t| tokenizer.token_id(t)))
        .collect();
    stops.dedup();
    stops
}
