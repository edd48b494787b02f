//! A GGUF file's tokenizer, rebuilt from its metadata as a `tokenizers` tokenizer: the BPE
//! vocabulary and merges (`tokenizer.ggml.tokens`, `tokenizer.ggml.merges`), the control tokens
//! (token type 3) as special tokens, byte-level decoding, and the pre-tokenizer llama.cpp names
//! in `tokenizer.ggml.pre`. Only the pre-tokenizers reproduced here are accepted; any other is
//! refused with its name rather than split differently from the model's own tokenizer.

use crate::model::ModelError;
use candle_core::quantized::gguf_file::{Content, Value};
use std::collections::HashMap;
use std::path::Path;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, Tokenizer};

/// llama.cpp's token type for control tokens (`<|im_start|>`): matched whole, never split.
const CONTROL: i32 = 3;

/// Reads the GGUF file at `path` and rebuilds its tokenizer.
pub fn read(path: &Path) -> Result<Tokenizer, ModelError> {
    let io = |source| ModelError::File {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let content = Content::read(&mut file).map_err(|e| config(path, e.to_string()))?;
    from_metadata(&content.metadata).map_err(|m| config(path, m))
}

fn config(path: &Path, message: String) -> ModelError {
    ModelError::Config {
        path: path.to_path_buf(),
        message,
    }
}

/// Qwen2's pre-tokenizer pattern (its tokenizer.json; llama.cpp's `qwen2`): single digits.
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Llama 3's (llama.cpp's `llama-bpe`): digits in threes.
const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// `pattern`'s matches isolated, then GPT-2's bytes without its own regex.
fn split_then_bytes(pattern: &str) -> Result<Sequence, String> {
    use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
    use tokenizers::SplitDelimiterBehavior;
    let split = Split::new(
        SplitPattern::Regex(pattern.into()),
        SplitDelimiterBehavior::Isolated,
        false,
    )
    .map_err(|e| format!("pre-tokenizer pattern: {e}"))?;
    Ok(Sequence::new(vec![
        split.into(),
        ByteLevel::new(false, true, false).into(),
    ]))
}

/// The tokenizer the metadata describes, or what in it is not supported.
pub fn from_metadata(meta: &HashMap<String, Value>) -> Result<Tokenizer, String> {
    let string = |k: &str| -> Result<&String, String> {
        meta.get(k)
            .ok_or_else(|| format!("no {k}"))?
            .to_string()
            .map_err(|e| format!("{k}: {e}"))
    };
    let strings = |k: &str| -> Result<Vec<&String>, String> {
        let v = meta.get(k).ok_or_else(|| format!("no {k}"))?;
        let v = v.to_vec().map_err(|e| format!("{k}: {e}"))?;
        v.iter()
            .map(|s| s.to_string().map_err(|e| format!("{k}: {e}")))
            .collect()
    };
    let model = string("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(format!(
            "tokenizer.ggml.model {model:?}: only byte-level BPE (\"gpt2\") is rebuilt"
        ));
    }
    let pre = string("tokenizer.ggml.pre")?;
    let pre_tokenizer = match pre.as_str() {
        // StarCoder's and SmolLM's, as llama.cpp splits them: every digit on its own, then GPT-2's
        // byte-level split. (SmolLM2's vocabulary has no multi-digit token, so for it the digit
        // split changes nothing; the byte-level regex does: without it 3 of the 242 reference
        // texts tokenize differently.)
        "smollm" | "starcoder" => Sequence::new(vec![
            Digits::new(true).into(),
            ByteLevel::new(false, true, true).into(),
        ]),
        // GPT-2's byte-level split alone.
        "gpt-2" => Sequence::new(vec![ByteLevel::new(false, true, true).into()]),
        // Qwen2's and Llama 3's splits (their tokenizer.json's Split, isolated), then bytes.
        "qwen2" => split_then_bytes(QWEN2_SPLIT)?,
        "llama-bpe" => split_then_bytes(LLAMA3_SPLIT)?,
        other => {
            return Err(format!(
                "tokenizer.ggml.pre {other:?}: its pre-tokenizer is not reproduced (smollm, \
                 starcoder, gpt-2, qwen2 and llama-bpe are)"
            ))
        }
    };
    let tokens = strings("tokenizer.ggml.tokens")?;
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.to_string(), i as u32))
        .collect();
    let merges = strings("tokenizer.ggml.merges")?
        .into_iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| format!("merge {m:?} is not two tokens"))
        })
        .collect::<Result<Vec<_>, _>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| format!("BPE: {e}"))?;
    let mut tokenizer = Tokenizer::new(bpe);
    tokenizer.with_pre_tokenizer(Some(pre_tokenizer));
    tokenizer.with_decoder(Some(ByteLevel::default()));
    let types = meta
        .get("tokenizer.ggml.token_type")
        .ok_or("no tokenizer.ggml.token_type")?
        .to_vec()
        .map_err(|e| e.to_string())?;
    let special: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, t)| t.to_i32().is_ok_and(|t| t == CONTROL))
        .map(|(tok, _)| AddedToken::from(tok.to_string(), true))
        .collect();
    tokenizer
        .add_special_tokens(special)
        .map_err(|e| format!("special tokens: {e}"))?;
    Ok(tokenizer)
}
