//! The prefix of a long text that is enough to tokenize it.
//!
//! The model keeps the first `max_seq_len` tokens of a text and the tokenizer would otherwise
//! normalise and split the whole text first: 1 MiB of text for 256 tokens. Tokenizers split
//! words at whitespace, and each word's tokens depend on that word alone, so a prefix that ends
//! where a word ends yields exactly the first tokens of the whole text. Once such a prefix yields
//! the model's full window, the rest of the text cannot change what the model sees. Texts without
//! a word boundary in reach (or whose prefix yields too few tokens, such as long runs of
//! whitespace) grow their prefix until it settles or is the whole text, which `--max-text-bytes`
//! bounds.

/// Bytes of text tokenized first per token the model keeps: English runs 4–6 bytes a token, so
/// one try almost always settles.
const BYTES_PER_TOKEN: usize = 16;

/// The first prefix length tried for a model that keeps `max_seq_len` tokens.
pub fn initial_bytes(max_seq_len: usize) -> usize {
    max_seq_len.saturating_mul(BYTES_PER_TOKEN).max(1024)
}

/// A prefix of a text.
#[derive(Debug, Clone, Copy)]
pub struct Cut<'a> {
    /// The prefix.
    pub text: &'a str,
    /// Whether it is the whole text.
    whole: bool,
    /// Whether it ends where a word ends (the next character is whitespace).
    at_word_end: bool,
}

impl Cut<'_> {
    /// Whether tokenizing this prefix gives the whole text's tokens: it is the whole text, or
    /// it ends at a word's end and already filled the model's window of `max_len` tokens
    /// (`tokens` counts the special tokens too, as `max_len` does).
    pub fn settles(&self, tokens: usize, max_len: usize) -> bool {
        self.whole || (self.at_word_end && tokens >= max_len)
    }
}

/// The longest prefix of `text` of at most `max_bytes` that ends at a word's end, or at a
/// character boundary when there is no whitespace to cut at.
pub fn cut(text: &str, max_bytes: usize) -> Cut<'_> {
    if text.len() <= max_bytes {
        return Cut {
            text,
            whole: true,
            at_word_end: true,
        };
    }
    let mut end = max_bytes;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    // The last whitespace at or before `end`: the prefix stops just before it.
    let word_end = if text[end..].starts_with(char::is_whitespace) {
        Some(end)
    } else {
        text[..end]
            .char_indices()
            .rev()
            .find(|(_, c)| c.is_whitespace())
            .map(|(i, _)| i)
    };
    match word_end {
        Some(i) => Cut {
            text: &text[..i],
            whole: false,
            at_word_end: true,
        },
        None => Cut {
            text: &text[..end],
            whole: false,
            at_word_end: false,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuts_before_the_last_whitespace_in_reach() {
        let c = cut("alpha beta gamma", 12);
        assert_eq!(c.text, "alpha beta");
        assert!(c.at_word_end && !c.whole);
        // The whitespace right at the limit counts.
        assert_eq!(cut("alpha beta gamma", 10).text, "alpha beta");
    }

    #[test]
    fn short_texts_are_whole() {
        let c = cut("short", 100);
        assert!(c.whole && c.settles(3, 256));
    }

    #[test]
    fn no_whitespace_cuts_at_a_char_boundary_and_never_settles_early() {
        let text = "é".repeat(100); // 2 bytes each
        let c = cut(&text, 51);
        assert_eq!(c.text.len(), 50);
        assert_eq!(cut(&format!("a{text}"), 51).text.len(), 51);
        assert!(!c.at_word_end);
        assert!(!c.settles(256, 256));
    }
}
