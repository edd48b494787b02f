//! A fast path for the commonest tokenizer and input: a BERT WordPiece `tokenizer.json` and a
//! text of printable ASCII. It gives the token ids the `tokenizers` crate gives, at a small
//! fraction of the cost.
//!
//! The crate normalizes with alignment tracking, splits through its generic pre-tokenizer
//! machinery and looks every character up in Unicode tables; on a worker whose model is fast
//! (a GPU, a small model) that was 44% of the worker's CPU time, more than the model. For
//! printable ASCII, each of those steps is simple byte work: BERT's normalizer only lowercases
//! (control characters, accents, Chinese characters and Unicode whitespace cannot occur), its
//! pre-tokenizer splits at the four whitespace bytes and isolates ASCII punctuation, and
//! WordPiece is greedy longest-match-first over the vocabulary, with `[UNK]` for a word it
//! cannot cover or that is longer than `max_input_chars_per_word`.
//!
//! Anything else goes to the crate: a tokenizer of another shape (checked once, from its
//! serialized form), and any text holding a byte outside printable ASCII, tab, newline and
//! carriage return, or an added token's content (`[CLS]`, `[MASK]` written in the text), which
//! the crate matches before normalizing. tests/embeddings.rs checks the two agree on the bench
//! corpus, the fixture texts and random texts built to hit every rule.

use crate::model::TokenIds;
use rustc_hash::FxHashMap;
use serde_json::Value;
use tokenizers::Tokenizer;

/// The tokenizer's rules, read from its serialized form, when it is the shape this path covers.
pub(super) struct FastWordPiece {
    /// Whether the normalizer lowercases.
    lowercase: bool,
    /// Vocabulary entries that start a word.
    words: FxHashMap<Box<str>, u32>,
    /// Entries that continue one, without the `##` prefix.
    pieces: FxHashMap<Box<str>, u32>,
    unk: u32,
    max_word_chars: usize,
    /// Special tokens before and after the text, as (id, type id).
    before: Vec<(u32, u32)>,
    after: Vec<(u32, u32)>,
    /// The text's type id.
    type_id: u32,
    /// Most tokens kept from the text (the model's limit less the special tokens).
    keep: usize,
    /// Added tokens' contents, lowercased: a text holding one goes to the crate.
    added: Vec<String>,
}

impl FastWordPiece {
    /// The fast path for `tokenizer` truncated to `max_len` tokens at the right, or `None` when
    /// the tokenizer is not a BERT WordPiece one it covers exactly.
    pub(super) fn new(tokenizer: &Tokenizer, max_len: usize) -> Option<Self> {
        let json = serde_json::to_value(tokenizer).ok()?;
        let lowercase = lowercases(&json["normalizer"])?;
        let pre = &json["pre_tokenizer"];
        let bert_pre = |p: &Value| p["type"] == "BertPreTokenizer";
        if !(bert_pre(pre)
            || pre["type"] == "Sequence" && pre["pretokenizers"].as_array()?.iter().all(bert_pre))
        {
            return None;
        }
        let model = &json["model"];
        if model["type"] != "WordPiece" {
            return None;
        }
        let prefix = model["continuing_subword_prefix"].as_str()?;
        let (mut words, mut pieces) = (FxHashMap::default(), FxHashMap::default());
        for (token, id) in model["vocab"].as_object()? {
            let id = u32::try_from(id.as_u64()?).ok()?;
            match token.strip_prefix(prefix) {
                Some(rest) if !prefix.is_empty() => pieces.insert(rest.into(), id),
                _ => words.insert(token.as_str().into(), id),
            };
        }
        let unk = *words.get(model["unk_token"].as_str()?)?;
        let (before, type_id, after) = template(&json["post_processor"])?;
        let keep = max_len.checked_sub(before.len() + after.len())?;
        let added = json["added_tokens"]
            .as_array()?
            .iter()
            .map(|a| a["content"].as_str().map(str::to_ascii_lowercase))
            .collect::<Option<Vec<_>>>()?;
        Some(Self {
            lowercase,
            words,
            pieces,
            unk,
            max_word_chars: usize::try_from(model["max_input_chars_per_word"].as_u64()?).ok()?,
            before,
            after,
            type_id,
            keep,
            added,
        })
    }

    /// `text`'s tokens, special tokens added and truncated, or `None` when the text is not one
    /// this path covers.
    pub(super) fn encode(&self, text: &str) -> Option<TokenIds> {
        let plain = |b: &u8| matches!(b, 0x20..=0x7e | b'\t' | b'\n' | b'\r');
        if !text.as_bytes().iter().all(plain) {
            return None;
        }
        let lower = text.to_ascii_lowercase();
        if self.added.iter().any(|a| lower.contains(a.as_str())) {
            return None;
        }
        let norm = if self.lowercase { &lower } else { text };
        let mut ids: Vec<u32> = self.before.iter().map(|&(id, _)| id).collect();
        let limit = ids.len() + self.keep;
        for word in words(norm) {
            if ids.len() >= limit {
                break;
            }
            self.word_pieces(word, &mut ids);
        }
        ids.truncate(limit);
        let mut type_ids = Vec::with_capacity(ids.len() + self.after.len());
        type_ids.extend(self.before.iter().map(|&(_, t)| t));
        type_ids.resize(ids.len(), self.type_id);
        for &(id, t) in &self.after {
            ids.push(id);
            type_ids.push(t);
        }
        Some(TokenIds { ids, type_ids })
    }

    /// WordPiece on one word: the longest vocabulary entry at each position, or `[UNK]` for the
    /// whole word when some position has none or the word is too long.
    fn word_pieces(&self, word: &str, out: &mut Vec<u32>) {
        if word.len() > self.max_word_chars {
            out.push(self.unk);
            return;
        }
        let first = out.len();
        let mut start = 0;
        while start < word.len() {
            let table = if start == 0 {
                &self.words
            } else {
                &self.pieces
            };
            let found = (start + 1..=word.len())
                .rev()
                .find_map(|end| table.get(&word[start..end]).map(|&id| (id, end)));
            let Some((id, end)) = found else {
                out.truncate(first);
                out.push(self.unk);
                return;
            };
            out.push(id);
            start = end;
        }
    }
}

/// BERT's pre-tokenizer on printable ASCII: words split at whitespace, each punctuation
/// character a word of its own.
fn words(text: &str) -> impl Iterator<Item = &str> {
    let bytes = text.as_bytes();
    let space = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let mut i = 0;
    std::iter::from_fn(move || {
        while i < bytes.len() && space(bytes[i]) {
            i += 1;
        }
        let start = i;
        if i < bytes.len() && bytes[i].is_ascii_punctuation() {
            i += 1;
        } else {
            while i < bytes.len() && !space(bytes[i]) && !bytes[i].is_ascii_punctuation() {
                i += 1;
            }
        }
        // The text is ASCII: every byte index is a character boundary.
        (i > start).then(|| &text[start..i])
    })
}

/// Whether the normalizer lowercases, if it is one that changes printable ASCII in no other way
/// (BERT's, Lowercase, the Unicode normal forms, StripAccents, Strip, or a sequence of them).
fn lowercases(n: &Value) -> Option<bool> {
    match n["type"].as_str() {
        None if n.is_null() => Some(false),
        Some("BertNormalizer") => n["lowercase"].as_bool(),
        Some("Lowercase") => Some(true),
        Some("NFC" | "NFD" | "NFKC" | "NFKD" | "StripAccents" | "Strip") => Some(false),
        Some("Sequence") => n["normalizers"]
            .as_array()?
            .iter()
            .map(lowercases)
            .try_fold(false, |any, l| Some(any | l?)),
        _ => None,
    }
}

/// The special tokens a single text gets before and after it, with the text's type id, from
/// the post-processor (none at all without one).
type Template = (Vec<(u32, u32)>, u32, Vec<(u32, u32)>);

fn template(p: &Value) -> Option<Template> {
    let id = |v: &Value| u32::try_from(v.as_u64()?).ok();
    match p["type"].as_str() {
        None if p.is_null() => Some((Vec::new(), 0, Vec::new())),
        Some("BertProcessing") => Some((
            vec![(id(&p["cls"][1])?, 0)],
            0,
            vec![(id(&p["sep"][1])?, 0)],
        )),
        Some("TemplateProcessing") => {
            let (mut before, mut after, mut seq) = (Vec::new(), Vec::new(), None);
            for piece in p["single"].as_array()? {
                if let Some(s) = piece.get("Sequence") {
                    if seq.replace(id(&s["type_id"])?).is_some() {
                        return None;
                    }
                    continue;
                }
                let s = piece.get("SpecialToken")?;
                let t = id(&s["type_id"])?;
                let side = if seq.is_some() {
                    &mut after
                } else {
                    &mut before
                };
                for i in p["special_tokens"][s["id"].as_str()?]["ids"].as_array()? {
                    side.push((id(i)?, t));
                }
            }
            Some((before, seq?, after))
        }
        _ => None,
    }
}
