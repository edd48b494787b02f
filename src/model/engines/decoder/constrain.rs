//! Constrained generation: a record's [`Constraint`] (a JSON schema, any JSON object, a regular
//! expression, a Lark grammar) compiled by llguidance into a matcher that says, before each
//! token is chosen, which tokens may come next. The decode loop masks every other token's logit
//! before the sampler sees the row, so greedy choice, seeded sampling and stop strings work
//! unchanged on what is left; the model's end tokens are allowed exactly when the text so far is
//! complete.
//!
//! A matcher's state is a function of the tokens it consumed: a resumed sequence rebuilds it by
//! consuming its checkpointed tokens, and its next mask is the one the uninterrupted run had.
//!
//! JSON is written without free whitespace (`", "` between items, `": "` after keys), unless the
//! schema says otherwise in llguidance's `x-guidance` key: free whitespace lets a small model
//! spend its tokens on newlines and never close the object.

pub use crate::record::generation::Constraint;
use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use std::sync::{Arc, Mutex};
use tokenizers::Tokenizer;

/// Compiled constraints kept for reuse; past this many the oldest is dropped.
const KEPT: usize = 64;

/// A model's vocabulary as llguidance sees it, and the constraints compiled for it so far: one
/// compiled form shared by every record that asks for the same constraint.
pub struct Grammars {
    factory: ParserFactory,
    compiled: Mutex<Vec<(String, Result<Matcher, String>)>>,
}

impl Grammars {
    /// The grammars of a model with `tokenizer` whose generation ends at `stop_ids`.
    pub fn new(tokenizer: &Tokenizer, stop_ids: &[u32]) -> Result<Self, String> {
        let why = |e: &dyn std::fmt::Display| format!("constraints on this model's tokens: {e}");
        let json: serde_json::Value = tokenizer
            .to_string(false)
            .map_err(|e| why(&e))
            .and_then(|s| serde_json::from_str(&s).map_err(|e| why(&e)))?;
        let words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| why(&e))?;
        let eos = *stop_ids
            .first()
            .ok_or_else(|| why(&"the model has no end token"))?;
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(stop_ids);
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| why(&e))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(Self {
            factory,
            compiled: Mutex::new(Vec::new()),
        })
    }

    /// A matcher at the start of `constraint`'s text, or why it does not compile.
    pub fn start(&self, constraint: &Constraint) -> Result<Matcher, String> {
        let key = constraint.key().to_string();
        let mut compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((_, kept)) = compiled.iter().find(|(k, _)| *k == key) {
            return kept.as_ref().map(Matcher::deep_clone).map_err(Clone::clone);
        }
        let made = self.compile(constraint);
        if compiled.len() == KEPT {
            compiled.drain(..1);
        }
        compiled.push((
            key,
            made.as_ref().map(Matcher::deep_clone).map_err(Clone::clone),
        ));
        made
    }

    fn compile(&self, constraint: &Constraint) -> Result<Matcher, String> {
        let grammar = match constraint {
            Constraint::JsonSchema(schema) => TopLevelGrammar::from_json_schema(compact(schema)),
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&serde_json::json!({ "type": "object" })))
            }
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        // llguidance reports a bad grammar as an error, and its own bugs as panics, which are
        // caught so that one record's schema never takes the worker down.
        let made = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            Matcher::new(self.factory.create_parser(grammar))
        }))
        .map_err(|p| {
            format!(
                "the constraint's compiler panicked: {}",
                crate::shutdown::panic_message(p.as_ref())
            )
        })?;
        match made.get_error() {
            Some(e) => Err(format!("the constraint does not compile: {e}")),
            None => Ok(made),
        }
    }
}

/// What compiling one constraint and computing one mask may cost: llguidance's fuel, counted in
/// its own units of work, so a pathological schema fails with a reason instead of stalling the
/// worker. Its defaults, but a smaller grammar (a schema of ~256 KiB, the record's limit) and
/// fewer lexer states (memory: 1-2 kB each, so at most ~100 MB per constraint).
fn limits() -> ParserLimits {
    ParserLimits {
        max_grammar_size: 100_000,
        max_lexer_states: 50_000,
        ..ParserLimits::default()
    }
}

/// `schema` with compact separators and no free whitespace, unless it sets its own.
fn compact(schema: &serde_json::Value) -> serde_json::Value {
    let mut schema = schema.clone();
    if let Some(map) = schema.as_object_mut() {
        map.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ", ",
                "key_separator": ": ",
            })
        });
    }
    schema
}

/// One sequence's constraint: where its text is, and the tokens allowed next.
pub struct Constrained {
    matcher: Matcher,
}

impl Constrained {
    /// At the start of the text, `matcher` from [`Grammars::start`].
    pub fn new(matcher: Matcher) -> Self {
        Self { matcher }
    }

    /// Consumes `tokens` (a checkpoint's, or the one just chosen); an end token ends the text.
    pub fn advance(&mut self, tokens: &[u32]) -> Result<(), String> {
        self.matcher
            .consume_tokens(tokens)
            .map_err(|e| format!("the constraint refused a token: {e}"))
    }

    /// The tokens allowed next (only end tokens once the text is complete and nothing may
    /// follow), or why none is.
    pub fn mask(&mut self) -> Result<SimpleVob, String> {
        let mask = self
            .matcher
            .compute_mask_or_eos()
            .map_err(|e| format!("the constraint failed: {e}"))?;
        if mask.is_zero() {
            return Err("the constraint allows no next token".into());
        }
        Ok(mask)
    }
}

/// Sets every logit `mask` does not allow to −∞ (tokens past the tokenizer's vocabulary, which a
/// model's padded output rows may have, included).
pub fn apply(mask: &SimpleVob, logits: &mut [f32]) {
    for (id, logit) in logits.iter_mut().enumerate() {
        if id >= mask.len() || !mask.is_allowed(id as TokenId) {
            *logit = f32::NEG_INFINITY;
        }
    }
}

/// The vocabulary's tokens as bytes (for the masks), and the model's own tokenizer for the
/// strings a grammar forces (so they are tokenized as the model would).
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false) {
                Ok(e) => e.get_ids().to_vec(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            // Part of a character: no tokenizer takes it, the trie's longest matches do.
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}
