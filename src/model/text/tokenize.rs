//! Texts to token ids as sentence-transformers makes them: the model's `tokenizer.json` (WordPiece,
//! Unigram/SentencePiece or BPE, with its normalizer, special tokens and post-processor),
//! `do_lower_case` applied first, truncation at the model's `max_seq_length` on the tokenizer's
//! side, no padding (the encoders pad, or not, themselves).

use super::prefix;
use super::wordpiece::FastWordPiece;
use crate::model::spec::ModelSpec;
use crate::model::ModelError;
use tokenizers::normalizers::{Lowercase, NormalizerWrapper, Sequence};
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams};

use crate::model::{Tagged, TokenIds};

/// The model's tokenizer, set up as sentence-transformers uses it.
pub struct TextTokenizer {
    inner: Tokenizer,
    /// The unknown token's id (`unk_token` of `tokenizer_config.json`), which a tagger reports
    /// by the text it stands for rather than by its spelling.
    unk_id: Option<u32>,
    /// The exact fast path for BERT WordPiece tokenizers and ASCII texts, where it applies.
    fast: Option<FastWordPiece>,
    max_len: usize,
    /// Where a long text may be cut to a prefix that gives the whole text's ids (see
    /// [`prefix`]), or `None` (tokenize it whole): only tokenizers whose every step the proof
    /// covers, truncated at the right.
    seams: Option<prefix::Seams>,
}

impl TextTokenizer {
    /// Loads `tokenizer.json` from the encoder's folder, truncating at `max_len` tokens.
    pub fn load(spec: &ModelSpec, max_len: usize) -> Result<Self, ModelError> {
        let path = spec.encoder_dir.join("tokenizer.json");
        if !path.is_file() {
            return Err(ModelError::File {
                path,
                source: std::io::ErrorKind::NotFound.into(),
            });
        }
        let mut inner = Tokenizer::from_file(&path)
            .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", path.display())))?;
        // A saved tokenizer.json may carry its own truncation and padding (all-MiniLM-L6-v2's
        // truncates at 128 and pads to 128); sentence-transformers truncates at max_seq_length
        // and pads to the batch's longest.
        let truncation = TruncationParams {
            max_length: max_len,
            direction: if spec.truncate_left {
                TruncationDirection::Left
            } else {
                TruncationDirection::Right
            },
            ..Default::default()
        };
        inner
            .with_truncation(Some(truncation))
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?
            .with_padding(None);
        if spec.do_lower_case {
            // What sentence-transformers does with `do_lower_case`: a Lowercase normalizer first.
            let mut steps = vec![NormalizerWrapper::Lowercase(Lowercase)];
            steps.extend(inner.get_normalizer().cloned());
            inner
                .with_normalizer(Some(Sequence::new(steps)))
                .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        }
        // Left truncation keeps the text's end: a prefix cannot stand for it.
        let seams = if spec.truncate_left {
            None
        } else {
            prefix::Seams::of(&inner)
                .inspect_err(|why| {
                    // Exact still, but a long text costs its whole length: worth knowing.
                    tracing::info!("long texts are tokenized whole, not by a prefix: {why}")
                })
                .ok()
        };
        let fast = if spec.truncate_left {
            None
        } else {
            FastWordPiece::new(&inner, max_len)
        };
        let unk_id = unk_token(&spec.encoder_dir).and_then(|t| inner.token_to_id(&t));
        Ok(Self {
            inner,
            unk_id,
            fast,
            max_len,
            seams,
        })
    }

    /// The texts as the model sees them: normalized, special tokens added, truncated, not padded.
    ///
    /// A long text is tokenized by its prefix where that is exact (see [`prefix`]): the model
    /// keeps only its first `max_len` tokens, so a 1 MiB text costs what a few KiB cost.
    pub fn encode(&self, texts: &[&str]) -> Result<Vec<TokenIds>, ModelError> {
        let first = prefix::initial_bytes(self.max_len);
        let cuts: Vec<prefix::Cut<'_>> = texts.iter().map(|t| self.cut(t, first)).collect();
        let mut out: Vec<Option<TokenIds>> = cuts.iter().map(|c| self.fast_path(c.text)).collect();
        let slow: Vec<usize> = (0..out.len()).filter(|&i| out[i].is_none()).collect();
        if !slow.is_empty() {
            let inputs: Vec<&str> = slow.iter().map(|&i| cuts[i].text).collect();
            let encoded = self
                .inner
                .encode_batch_fast(inputs, true)
                .map_err(tokenizer_error)?;
            for (i, e) in slow.into_iter().zip(encoded) {
                out[i] = Some(ids_of(&e));
            }
        }
        let mut out: Vec<TokenIds> = out.into_iter().flatten().collect();
        for (i, mut cut) in cuts.into_iter().enumerate() {
            // Grow the prefix until it fills the model's window (then the rest of the text
            // cannot change the kept tokens), or is the whole text; each try is longer.
            let mut min = first;
            while !cut.settles(out[i].len(), self.max_len) {
                min = min.saturating_mul(2).max(cut.text.len() + 1);
                cut = self.cut(texts[i], min);
                out[i] = self.encode_one(cut.text)?;
            }
        }
        Ok(out)
    }

    /// The prefix of `text` to tokenize first: cut at the first seam past `min_bytes` where
    /// this tokenizer may be cut, else the whole text.
    fn cut<'a>(&self, text: &'a str, min_bytes: usize) -> prefix::Cut<'a> {
        match &self.seams {
            Some(seams) => seams.cut(text, min_bytes),
            None => prefix::Cut::whole(text),
        }
    }

    /// One text, by the fast path where it applies, else by the tokenizer.
    fn encode_one(&self, text: &str) -> Result<TokenIds, ModelError> {
        match self.fast_path(text) {
            Some(t) => Ok(t),
            None => Ok(ids_of(
                &self
                    .inner
                    .encode_fast(text, true)
                    .map_err(tokenizer_error)?,
            )),
        }
    }

    fn fast_path(&self, text: &str) -> Option<TokenIds> {
        self.fast.as_ref()?.encode(text)
    }

    /// The tokenizer's own result for each text, without the fast path (for tests that compare
    /// the two).
    pub fn encode_slow(&self, texts: &[&str]) -> Result<Vec<TokenIds>, ModelError> {
        let encoded = self
            .inner
            .encode_batch(texts.to_vec(), true)
            .map_err(tokenizer_error)?;
        Ok(encoded.iter().map(ids_of).collect())
    }

    /// Whether the fast path applies to this tokenizer at all.
    pub fn has_fast_path(&self) -> bool {
        self.fast.is_some()
    }

    /// How many leading tokens a prompt accounts for, as sentence-transformers counts them for
    /// `include_prompt: false`: the prompt tokenized alone, special tokens included, less a
    /// trailing special token (`[SEP]`, `</s>`).
    pub fn prompt_tokens(&self, prompt: &str) -> Result<usize, ModelError> {
        let e = self.inner.encode(prompt, true).map_err(tokenizer_error)?;
        let trailing = e.get_special_tokens_mask().last() == Some(&1);
        Ok(e.len() - usize::from(trailing))
    }
}

impl TextTokenizer {
    /// Texts, some with a second text (`text_pair`), as the sequence heads read them: a pair
    /// through the tokenizer's pair template, both truncated together `longest_first` (the
    /// longer loses a token at a time) as transformers truncates pairs; a single text as
    /// [`TextTokenizer::encode`] does.
    pub fn encode_pairs(
        &self,
        inputs: &[(&str, Option<&str>)],
    ) -> Result<Vec<TokenIds>, ModelError> {
        let singles: Vec<&str> = inputs
            .iter()
            .filter(|(_, pair)| pair.is_none())
            .map(|(t, _)| *t)
            .collect();
        let pairs: Vec<tokenizers::EncodeInput<'_>> = inputs
            .iter()
            .filter_map(|(t, pair)| pair.map(|p| (*t, p).into()))
            .collect();
        let mut singles = self.encode(&singles)?.into_iter();
        let mut pairs = self
            .inner
            .encode_batch_fast(pairs, true)
            .map_err(tokenizer_error)?
            .into_iter();
        inputs
            .iter()
            .map(|(_, pair)| {
                let next = match pair {
                    None => singles.next(),
                    Some(_) => pairs.next().map(|e| ids_of(&e)),
                };
                next.ok_or_else(|| ModelError::Tokenizer("the tokenizer lost an input".into()))
            })
            .collect()
    }

    /// Texts with each token's character offsets, special-token flags and spelling, for a
    /// tagger (`return_offsets_mapping`, `return_special_tokens_mask` in transformers).
    pub fn encode_tagged(&self, texts: &[&str]) -> Result<Vec<Tagged>, ModelError> {
        texts
            .iter()
            .map(|text| {
                let e = self
                    .inner
                    .encode_char_offsets(*text, true)
                    .map_err(tokenizer_error)?;
                Ok(Tagged {
                    ids: ids_of(&e),
                    offsets: e.get_offsets().to_vec(),
                    special: e
                        .get_special_tokens_mask()
                        .iter()
                        .map(|&m| m == 1)
                        .collect(),
                    tokens: e.get_tokens().to_vec(),
                })
            })
            .collect()
    }

    /// Tokens joined back into text by the tokenizer's decoder (transformers'
    /// `convert_tokens_to_string`), or by spaces when it has none.
    pub fn join_tokens(&self, tokens: Vec<String>) -> Result<String, ModelError> {
        use tokenizers::Decoder;
        match self.inner.get_decoder() {
            Some(decoder) => decoder.decode(tokens).map_err(tokenizer_error),
            None => Ok(tokens.join(" ")),
        }
    }

    /// The unknown token's id, where the tokenizer names one.
    pub fn unk_id(&self) -> Option<u32> {
        self.unk_id
    }
}

/// `unk_token` of the folder's `tokenizer_config.json` (a string or `{"content": …}`).
fn unk_token(dir: &std::path::Path) -> Option<String> {
    let bytes = std::fs::read(dir.join("tokenizer_config.json")).ok()?;
    let config: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
    let unk = config.get("unk_token")?;
    unk.as_str()
        .or_else(|| unk.get("content").and_then(serde_json::Value::as_str))
        .map(str::to_string)
}

fn ids_of(e: &tokenizers::Encoding) -> TokenIds {
    TokenIds {
        ids: e.get_ids().to_vec(),
        type_ids: e.get_type_ids().to_vec(),
    }
}

fn tokenizer_error(e: tokenizers::Error) -> ModelError {
    ModelError::Tokenizer(e.to_string())
}
