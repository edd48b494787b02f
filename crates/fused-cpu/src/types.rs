//! The types callers configure and feed the networks with: the text encoder's shape, checkpoint
//! layout, pooling and tokenized input; the precision the text encoder's and the image towers'
//! dense layers compute in; and which int8 kernels this CPU has.

use crate::packed::{Dot, Fma, Format};

/// The shape of a BERT model, from its config.json.
#[derive(Debug, Clone, Copy)]
pub struct Dims {
    /// Hidden size.
    pub hidden: usize,
    /// Attention heads.
    pub heads: usize,
    /// Feed-forward size.
    pub intermediate: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// Position embeddings (the longest text the model can take).
    pub max_positions: usize,
    /// Token type embeddings.
    pub type_vocab: usize,
    /// Layer norm epsilon.
    pub eps: f32,
    /// The position id of a text's first token: 0 for BERT; `padding_idx + 1` for RoBERTa and
    /// XLM-RoBERTa, whose position table keeps its first rows for padding.
    pub position_offset: usize,
    /// How the checkpoint names its tensors (and whether it has token types).
    pub layout: Layout,
}

/// How a checkpoint names its tensors. The networks compute the same function (post-norm
/// layers, exact GELU); DistilBERT has no token-type embeddings and its own names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Layout {
    /// `BertModel`, `RobertaModel` and `XLMRobertaModel` names (`encoder.layer.N.attention…`),
    /// with or without a `bert.`, `roberta.` or `model.` prefix.
    #[default]
    Bert,
    /// `DistilBertModel` names (`transformer.layer.N.attention.q_lin…`), with or without a
    /// `distilbert.` prefix; token type ids are ignored, as DistilBERT's forward takes none.
    DistilBert,
}

/// The tensor names of one checkpoint layout.
pub(crate) struct Names {
    pub(crate) prefixes: &'static [&'static str],
    pub(crate) word: &'static str,
    pub(crate) position: &'static str,
    pub(crate) token_type: Option<&'static str>,
    pub(crate) emb_norm: &'static str,
    pub(crate) layer: &'static str,
    /// Query, key, value, attention output, attention norm, intermediate, output, output norm.
    pub(crate) parts: [&'static str; 8],
}

impl Layout {
    /// One layer's tensor names, below its `…layer.N.`: query, key, value, attention output,
    /// attention norm, intermediate, output, output norm (each with `.weight` and `.bias`).
    pub fn layer_parts(self) -> [&'static str; 8] {
        self.names().parts
    }

    /// Where the layers sit: `encoder.layer` or `transformer.layer`.
    pub fn layer_stack(self) -> &'static str {
        self.names().layer
    }

    pub(crate) fn names(self) -> Names {
        match self {
            Self::Bert => Names {
                prefixes: &["", "bert.", "roberta.", "model."],
                word: "embeddings.word_embeddings",
                position: "embeddings.position_embeddings",
                token_type: Some("embeddings.token_type_embeddings"),
                emb_norm: "embeddings.LayerNorm",
                layer: "encoder.layer",
                parts: [
                    "attention.self.query",
                    "attention.self.key",
                    "attention.self.value",
                    "attention.output.dense",
                    "attention.output.LayerNorm",
                    "intermediate.dense",
                    "output.dense",
                    "output.LayerNorm",
                ],
            },
            Self::DistilBert => Names {
                prefixes: &["", "distilbert."],
                word: "embeddings.word_embeddings",
                position: "embeddings.position_embeddings",
                token_type: None,
                emb_norm: "embeddings.LayerNorm",
                layer: "transformer.layer",
                parts: [
                    "attention.q_lin",
                    "attention.k_lin",
                    "attention.v_lin",
                    "attention.out_lin",
                    "sa_layer_norm",
                    "ffn.lin1",
                    "ffn.lin2",
                    "output_layer_norm",
                ],
            },
        }
    }
}

/// How a text's token vectors become one vector (sentence-transformers' `Pooling` module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pooling {
    /// The first pooled token's vector: `[CLS]` or `<s>`, or with a left-out prompt the first
    /// token after it (sentence-transformers takes the first position its pooling mask keeps).
    Cls,
    /// The mean over the pooled tokens.
    Mean,
    /// The element-wise maximum over the pooled tokens.
    Max,
    /// The sum over the pooled tokens divided by the square root of their count.
    MeanSqrtLen,
}

/// One text, tokenized.
#[derive(Debug, Clone, Copy)]
pub struct Tokens<'a> {
    /// Token ids, without padding.
    pub ids: &'a [u32],
    /// Token type ids, one per token.
    pub type_ids: &'a [u32],
    /// Leading tokens left out of mean, max and mean-sqrt pooling: a prompt the model's pooling
    /// excludes (`include_prompt: false`); 0 pools every token.
    pub skip: usize,
}

/// The arithmetic of the dense layers (about 95% of the work); attention, softmax, layer norm,
/// GELU, the residual stream and pooling are f32 in every precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Precision {
    /// f32 products: AVX-512 F where the CPU has it, else AVX2/FMA (this crate's kernels), else
    /// (Arm, older x86-64) the `gemm` crate's.
    F32,
    /// bf16 products with f32 sums, on CPUs with AVX-512 BF16
    /// ([`bf16_supported`](crate::bf16_supported)).
    Bf16,
    /// int8 products with i32 sums (weights per output column, activations per token), on
    /// CPUs with integer dot products ([`int8_supported`]: AVX-512 VNNI, AVX-VNNI, AVX2, Arm's
    /// dotprod): two to four times f32's multiply-adds per instruction; how close its vectors
    /// stay to f32's depends on the model (and AVX2's activations are coarser, so there the
    /// feed-forward output stays f32: see `Layer::formats`), so check them.
    Int8,
    /// The decoder's dense layers left in the GGUF file's block formats (Q4_0, Q4_1, Q8_0,
    /// Q4_K, Q5_K, Q6_K), multiplied by activations rounded to 8 bits per 32 as llama.cpp
    /// multiplies them (`crate::quant`); a tensor in another form is f32. The decoder's only.
    Gguf,
}

/// The widest instructions the dense layers may use: what this CPU has, or what a narrower CPU
/// class runs, to compare classes on one machine and to test their paths on a wider CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Widest {
    /// Everything this CPU has, AMX's tiles included.
    #[default]
    All,
    /// Everything but AMX: what a Sapphire Rapids runs with AMX off, as a Zen 4 or an Ice Lake
    /// (AVX-512, with VNNI and BF16 where the CPU has them) runs.
    NoAmx,
    /// AVX2 at most: what a CPU with neither AVX-512 nor AVX-VNNI runs (AMD's Zen 2 and 3).
    Avx2,
}

impl Widest {
    /// Whether it leaves only AVX2.
    pub(crate) fn avx2_only(self) -> bool {
        self == Self::Avx2
    }
}

impl Precision {
    /// The packed format this precision multiplies in on this CPU (`None`: the `gemm` crate's
    /// f32, where the CPU has neither AVX-512 nor AVX2: Arm's NEON, older x86-64), or why this CPU
    /// (or the limit) cannot compute in it.
    pub(crate) fn format(self, widest: Widest) -> Result<Option<Format>, String> {
        let avx2_only = widest.avx2_only();
        match self {
            Self::F32 => Ok(Fma::best(avx2_only).map(Format::F32)),
            Self::Bf16 if avx2_only => Err(
                "bf16 needs AVX-512 BF16, and the dense layers are limited to AVX2 \
                     (--cpu-kernels avx2)"
                    .into(),
            ),
            Self::Bf16 if !Format::Bf16.supported() => {
                Err("bf16 needs a CPU with AVX-512 BF16 (avx512_bf16); this one has none".into())
            }
            // AMX's tiles where the CPU and Linux give them; the same products, many times the
            // rate.
            Self::Bf16 if Format::Bf16Amx.supported() && widest == Widest::All => {
                Ok(Some(Format::Bf16Amx))
            }
            Self::Bf16 => Ok(Some(Format::Bf16)),
            Self::Int8 => Dot::best(avx2_only)
                .map(|dot| Some(Format::Int8(dot)))
                .ok_or_else(|| {
                    "int8 needs integer dot products (AVX-512 VNNI, AVX-VNNI or AVX2 on x86-64, \
                     dotprod on Arm); this CPU has none"
                        .into()
                }),
            Self::Gguf => {
                Err("GGUF block formats are the decoder's; this network reads none".into())
            }
        }
    }
}

/// Whether this CPU runs an int8 kernel (AVX-512 VNNI, AVX-VNNI, AVX2 or Arm's dotprod).
pub fn int8_supported() -> bool {
    Dot::best(false).is_some()
}

/// The integer dot products int8 runs on here ("AVX-512 VNNI", "AVX2 (vpmaddubsw)", …), if any.
pub fn int8_kernels() -> Option<&'static str> {
    Dot::best(false).map(Dot::name)
}
