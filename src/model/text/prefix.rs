//! The prefix of a long text that is enough to tokenize it, and why it is exact.
//!
//! The model keeps the first `max_seq_len` tokens of a text, and the tokenizer would otherwise
//! normalise and split the whole text first: 1 MiB of text for 256 tokens. So a long text is
//! tokenized by a prefix that ends at a *seam*, and the prefix is accepted once its tokens fill
//! the model's window. A seam is a seam character (`' '`, or also `'\t'`, `'\n'`, `'\r'` where
//! the tokenizer allows it, see [`Seams`]) right after a printable ASCII character other than
//! the space (`!` to `~`): `…a␠…`. The prefix is everything before the seam character.
//!
//! # Why the prefix's tokens are the whole text's first tokens
//!
//! Write the text as `T = A + s + B`: `A` the prefix, ending in the printable ASCII character
//! `a`; `s` the seam character; `B` anything. The `tokenizers` pipeline runs four steps, and for
//! the tokenizers [`Seams::of`] accepts, each leaves what comes before `s` as `A` alone gives it:
//!
//! 1. **Added tokens** are matched first, in the raw text and then in each normalized piece.
//!    No accepted tokenizer has an added token containing whitespace, so no match spans `s`;
//!    the matches starting in `A` are the same in `A` and in `T` (leftmost-longest among
//!    candidates that lie wholly within `A`); a single-word token ending at the seam sees a
//!    non-word character after it in `T` and the end of text in `A`, both word boundaries; and
//!    `lstrip`/`rstrip` only absorb whitespace, which stops at `a`, so they never reach into
//!    `A`. The pieces before the seam are therefore `A`'s own; only the piece holding the
//!    seam, `X + s + Y` (`X` a suffix of `A`, maybe empty), differs from `A`'s last piece `X`.
//! 2. **The normalizer** is a sequence of BERT's (clean_text, CJK spacing, accent stripping,
//!    lowercasing), `Lowercase`, `Nmt`, `StripAccents` and the four Unicode normal forms.
//!    Each is either character by character, and then leaves a printable ASCII character
//!    printable ASCII and `s` itself or `' '`; or a normal form, and every normal form has a
//!    boundary before an ASCII character (combining class 0, no decomposition, never the
//!    second half of a composition) and composes nothing onto ASCII whitespace, so
//!    `NF(X + s + Y) = NF(X) + s + NF(Y)`, and `NF(X)` still ends in `a`. So the piece
//!    normalizes to `N(X) + s' + N(Y)`: `N(X)` exactly what `A` gives, ending in a printable
//!    ASCII character `a'`, and `s'` whitespace. (Deleting characters, the cause of the old
//!    bug, cannot join `X` to `Y` here: `s` is never deleted.)
//! 3. **The pre-tokenizer** splits that piece at `s'`. Before the first step that splits at
//!    whitespace only `Punctuation` and `Digits` are accepted: they decide character by
//!    character and neither treats whitespace as a delimiter, so the pieces before `s'` are
//!    those of `N(X)` alone except that the last, `L` (ending in `a'`, or empty), may run on
//!    into `L + s' + R`. The splitting step is `BertPreTokenizer` or `WhitespaceSplit` (a split
//!    at every whitespace character), `Whitespace` (`\w+|[^\w\s]+`: no match holds
//!    whitespace), `Metaspace` with `split` (it turns `' '` into `▁` and starts a piece at each
//!    `▁`; only `' '` is a seam for it), or `ByteLevel` with its regex. In that regex no
//!    alternative takes whitespace after a non-whitespace character, so no match runs from `L`
//!    across `s'`; and a match that ends at `a'` ends there because of the next character,
//!    whitespace in `T` and the end of text in `A`, which every alternative treats alike
//!    (`\p{L}+`, `\p{N}+`, `[^\s\p{L}\p{N}]+` and the contractions stop at both, `(?!\S)`
//!    holds at both). So the pieces before the seam are those of `L` alone; any later
//!    pre-tokenizer works piece by piece and sees the same pieces.
//! 4. **The model** (WordPiece, WordLevel, Unigram, or BPE without dropout) tokenizes each
//!    piece on its own, deterministically.
//!
//! So `A`'s tokens are the first tokens of `T`. Once they fill the window (the prefix encodes
//! to `max_len` tokens, special tokens included), right truncation keeps the same tokens from
//! both, and the post-processor adds the same special tokens to the same kept tokens.
//!
//! Anything else is tokenized whole: a normalizer that is not character by character nor a
//! normal form (SentencePiece's precompiled charsmap, `Replace`, `Strip`, `Prepend`, byte-level),
//! no pre-tokenizer or none that splits at whitespace (the whole text is one word), an added
//! token holding whitespace, BPE dropout, and left truncation (the caller checks that one). So
//! is a text with no seam past the first limit (CJK or Thai without ASCII punctuation, one huge
//! word), as such texts were before.
//!
//! The old rule cut before any whitespace character and assumed each word's tokens depend on
//! that word alone. BERT's normalizer deletes the vertical tab, form feed and NEL (Unicode
//! control characters that Rust counts as whitespace), so `hel\u{0B}lo` is one word `hello` in
//! the whole text while the prefix ended at `hel`; byte-level BPE splits a run of spaces cut in
//! two differently from the whole run. tests/prefix_exact.rs checks the ids against the
//! `tokenizers` crate on whole random texts, for every tokenizer the project ships a model for.

use tokenizers::models::ModelWrapper;
use tokenizers::normalizers::NormalizerWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::Tokenizer;

/// Bytes of text tokenized first per token the model keeps: English runs 4–6 bytes a token, so
/// one try almost always settles.
const BYTES_PER_TOKEN: usize = 16;

/// The first prefix length tried for a model that keeps `max_seq_len` tokens.
pub fn initial_bytes(max_seq_len: usize) -> usize {
    max_seq_len.saturating_mul(BYTES_PER_TOKEN).max(1024)
}

/// The characters a tokenizer may be cut before (see the module doc), for the tokenizers whose
/// prefix is exact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Seams {
    /// The seam characters: `' '` alone, or the four ASCII whitespace characters.
    middle: &'static [u8],
}

/// The seam character where the first splitting pre-tokenizer is Metaspace, which splits at
/// `' '` only.
const SPACE: &[u8] = b" ";
/// The seam characters for the other splitters, which split at any whitespace.
const ASCII_WHITESPACE: &[u8] = b" \t\n\r";

impl Seams {
    /// Where `tokenizer` (as the model uses it, `do_lower_case` included) may be cut, or why it
    /// may not, so a long text is tokenized whole: the argument in the module doc holds only for
    /// the pipeline steps it names.
    pub fn of(tokenizer: &Tokenizer) -> Result<Self, String> {
        if let Some(n) = tokenizer.get_normalizer() {
            normalizer_keeps_seams(n)?;
        }
        let pre = tokenizer
            .get_pre_tokenizer()
            .ok_or("no pre-tokenizer: the whole text is one word")?;
        let mut steps = Vec::new();
        flatten(pre, &mut steps);
        let middle = first_split(&steps)?;
        match tokenizer.get_model() {
            ModelWrapper::BPE(b) if b.dropout.is_some_and(|p| p > 0.0) => {
                return Err("BPE with dropout".into())
            }
            _ => {}
        }
        let decoder = tokenizer.get_added_tokens_decoder();
        if let Some(t) = decoder
            .values()
            .find(|t| t.content.contains(char::is_whitespace))
        {
            return Err(format!("added token {:?} holds whitespace", t.content));
        }
        Ok(Self { middle })
    }

    /// The shortest prefix of `text` that ends at a seam at or past byte `min_bytes`, or the
    /// whole text when there is none (or the text is no longer than `min_bytes`).
    pub fn cut<'a>(&self, text: &'a str, min_bytes: usize) -> Cut<'a> {
        let bytes = text.as_bytes();
        if bytes.len() <= min_bytes {
            return Cut::whole(text);
        }
        let mut i = min_bytes.max(1);
        while i < bytes.len() {
            if self.middle.contains(&bytes[i]) && bytes[i - 1].is_ascii_graphic() {
                // An ASCII byte: a character boundary.
                return Cut {
                    text: &text[..i],
                    whole: false,
                };
            }
            i += 1;
        }
        Cut::whole(text)
    }
}

/// Whether the normalizer is built only of steps that keep a seam (module doc, step 2).
fn normalizer_keeps_seams(n: &NormalizerWrapper) -> Result<(), String> {
    match n {
        NormalizerWrapper::BertNormalizer(_)
        | NormalizerWrapper::Lowercase(_)
        | NormalizerWrapper::Nmt(_)
        | NormalizerWrapper::StripAccents(_)
        | NormalizerWrapper::NFC(_)
        | NormalizerWrapper::NFD(_)
        | NormalizerWrapper::NFKC(_)
        | NormalizerWrapper::NFKD(_) => Ok(()),
        NormalizerWrapper::Sequence(s) => s.as_ref().iter().try_for_each(normalizer_keeps_seams),
        other => Err(format!("normalizer {}", kind(other))),
    }
}

/// The pre-tokenizer's steps, sequences flattened, in order.
fn flatten<'a>(p: &'a PreTokenizerWrapper, out: &mut Vec<&'a PreTokenizerWrapper>) {
    match p {
        PreTokenizerWrapper::Sequence(s) => s.as_ref().iter().for_each(|p| flatten(p, out)),
        other => out.push(other),
    }
}

/// The seam characters of the first step that splits at whitespace, when every step before it
/// keeps a seam (module doc, step 3).
fn first_split(steps: &[&PreTokenizerWrapper]) -> Result<&'static [u8], String> {
    for step in steps {
        match step {
            PreTokenizerWrapper::BertPreTokenizer(_)
            | PreTokenizerWrapper::Whitespace(_)
            | PreTokenizerWrapper::WhitespaceSplit(_) => return Ok(ASCII_WHITESPACE),
            PreTokenizerWrapper::ByteLevel(b) if b.use_regex => return Ok(ASCII_WHITESPACE),
            PreTokenizerWrapper::Metaspace(m) if m.get_split() => return Ok(SPACE),
            PreTokenizerWrapper::Punctuation(_) | PreTokenizerWrapper::Digits(_) => {}
            other => return Err(format!("pre-tokenizer {}", kind(other))),
        }
    }
    Err("no pre-tokenizer step splits at whitespace".into())
}

/// A pipeline step's `type`, for the reason a tokenizer is tokenized whole.
fn kind<T: serde::Serialize>(step: &T) -> String {
    serde_json::to_value(step)
        .ok()
        .and_then(|v| v["type"].as_str().map(str::to_string))
        .unwrap_or_else(|| "of an unknown kind".into())
}

/// A prefix of a text.
#[derive(Debug, Clone, Copy)]
pub struct Cut<'a> {
    /// The prefix.
    pub text: &'a str,
    /// Whether it is the whole text.
    whole: bool,
}

impl<'a> Cut<'a> {
    /// The whole text, for a tokenizer that may not be cut or a text too short to.
    pub fn whole(text: &'a str) -> Self {
        Self { text, whole: true }
    }

    /// Whether tokenizing this prefix gives the whole text's tokens: it is the whole text, or
    /// it ends at a seam and already filled the model's window of `max_len` tokens (`tokens`
    /// counts the special tokens too, as `max_len` does).
    pub fn settles(&self, tokens: usize, max_len: usize) -> bool {
        self.whole || tokens >= max_len
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokenizers::models::bpe::BPE;
    use tokenizers::models::unigram::Unigram;
    use tokenizers::models::wordpiece::WordPiece;
    use tokenizers::normalizers::{BertNormalizer, Lowercase, Replace, Sequence, Strip, NFKC};
    use tokenizers::pre_tokenizers::bert::BertPreTokenizer;
    use tokenizers::pre_tokenizers::byte_level::ByteLevel;
    use tokenizers::pre_tokenizers::digits::Digits;
    use tokenizers::pre_tokenizers::metaspace::{Metaspace, PrependScheme};
    use tokenizers::pre_tokenizers::punctuation::Punctuation;
    use tokenizers::pre_tokenizers::sequence::Sequence as PreSequence;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    use tokenizers::AddedToken;

    const ALL: Seams = Seams {
        middle: ASCII_WHITESPACE,
    };

    #[test]
    fn cuts_at_the_first_seam_at_or_past_the_limit() {
        let c = ALL.cut("alpha beta gamma", 3);
        assert_eq!(c.text, "alpha");
        assert!(!c.whole);
        assert_eq!(ALL.cut("alpha beta gamma", 5).text, "alpha");
        assert_eq!(ALL.cut("alpha beta gamma", 6).text, "alpha beta");
        assert_eq!(ALL.cut("alpha\nbeta", 1).text, "alpha");
        let space = Seams { middle: SPACE };
        assert_eq!(space.cut("alpha\nbeta gamma", 1).text, "alpha\nbeta");
    }

    #[test]
    fn a_seam_follows_a_printable_ascii_character() {
        // Deleted whitespace, non-ASCII or control characters before the whitespace, CJK
        // without spaces: no seam, the whole text.
        for text in [
            "hel\u{0B}lo",
            "hel\u{0C}lo",
            "hel\u{85}lo",
            "é beta",
            "\u{1} beta",
            "\u{301} beta",
            "漢字漢字 漢字",
            "  beta",
        ] {
            let c = ALL.cut(text, 1);
            assert!(c.whole, "{text:?} cut to {:?}", c.text);
        }
        // Whatever follows the seam character.
        for (text, prefix) in [
            ("alpha, beta", "alpha,"),
            ("alpha  beta", "alpha"),
            ("alpha \u{301}beta", "alpha"),
            ("alpha\t\u{0B}beta", "alpha"),
            ("(漢字) 漢字", "(漢字)"),
            ("trailing ", "trailing"),
        ] {
            assert_eq!(ALL.cut(text, 1).text, prefix, "{text:?}");
        }
    }

    #[test]
    fn short_texts_are_whole_and_settle() {
        let c = ALL.cut("short", 100);
        assert!(c.whole && c.settles(3, 256));
        assert!(Cut::whole("x").settles(0, 256));
        let c = ALL.cut("alpha beta gamma", 3);
        assert!(!c.settles(255, 256) && c.settles(256, 256));
    }

    fn wordpiece() -> Tokenizer {
        let mut t = Tokenizer::new(WordPiece::default());
        t.with_normalizer(Some(BertNormalizer::default()))
            .expect("normalizer");
        t.with_pre_tokenizer(Some(BertPreTokenizer));
        t
    }

    #[test]
    fn accepts_the_pipelines_the_argument_covers() {
        assert_eq!(Seams::of(&wordpiece()), Ok(ALL));
        let mut t = wordpiece();
        t.with_normalizer(Some(Sequence::new(vec![
            Lowercase.into(),
            NFKC.into(),
            BertNormalizer::default().into(),
        ])))
        .expect("normalizer");
        t.with_pre_tokenizer(Some(PreSequence::new(vec![
            Punctuation::default().into(),
            Digits::new(true).into(),
            WhitespaceSplit.into(),
            Metaspace::new('▁', PrependScheme::Always, false).into(),
        ])));
        assert_eq!(Seams::of(&t), Ok(ALL));

        let mut unigram = Tokenizer::new(Unigram::default());
        unigram.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::Always, true)));
        assert_eq!(Seams::of(&unigram), Ok(Seams { middle: SPACE }));

        let mut bpe = Tokenizer::new(BPE::default());
        bpe.with_pre_tokenizer(Some(ByteLevel::default()));
        assert_eq!(Seams::of(&bpe), Ok(ALL));
    }

    #[test]
    fn refuses_everything_else() {
        let refused = |t: &Tokenizer| Seams::of(t).expect_err("refused");

        let mut t = wordpiece();
        t.with_normalizer(Some(Replace::new("a", "b").expect("pattern")))
            .expect("normalizer");
        assert!(refused(&t).contains("Replace"), "{}", refused(&t));
        t.with_normalizer(Some(Sequence::new(vec![
            Lowercase.into(),
            Strip::new(true, true).into(),
        ])))
        .expect("normalizer");
        assert!(refused(&t).contains("Strip"), "{}", refused(&t));

        let mut t = wordpiece();
        t.with_pre_tokenizer(None::<BertPreTokenizer>);
        refused(&t);
        t.with_pre_tokenizer(Some(Metaspace::new('▁', PrependScheme::Always, false)));
        refused(&t);
        t.with_pre_tokenizer(Some(ByteLevel::default().use_regex(false)));
        refused(&t);
        // A step that rewrites whitespace before the split.
        t.with_pre_tokenizer(Some(PreSequence::new(vec![
            ByteLevel::default().use_regex(false).into(),
            WhitespaceSplit.into(),
        ])));
        refused(&t);
        t.with_pre_tokenizer(Some(Punctuation::default()));
        refused(&t);

        let mut t = wordpiece();
        t.add_special_tokens([AddedToken::from("[NEW LINE]", true)])
            .expect("added token");
        assert!(refused(&t).contains("added token"), "{}", refused(&t));

        let mut bpe = Tokenizer::new(
            BPE::builder()
                .dropout(0.1)
                .build()
                .expect("a BPE with dropout"),
        );
        bpe.with_pre_tokenizer(Some(ByteLevel::default()));
        refused(&bpe);
    }
}
