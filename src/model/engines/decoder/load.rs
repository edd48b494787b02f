//! Reading a decoder LLM: a GGUF file (llama.cpp's format: its weights in the block formats the
//! CPU decoder multiplies directly, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, handed
//! over as blocks; any other widened to f32 by candle) or a transformers folder (`config.json`
//! and safetensors in f32, f16 or bf16), into the CPU decoder (`spotinfer_fused_cpu::CpuDecoder`),
//! with its tokenizer, chat template and special tokens. What the decoder would compute differently from the model's own library (another
//! rotary scaling, sliding-window attention, another activation) is refused here with the reason.

use super::gguf_tokenizer;
use super::paged::decoder::PagedDecoder;
use super::Network;
use crate::model::{CpuKernels, ModelError};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use serde_json::Value as Json;
use spotinfer_fused_cpu::{
    BlockFormat, BlockMatrix, CpuDecoder, DecoderDims, FusedError, Precision, Weights,
};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tokenizers::Tokenizer;

/// Which network a generation model is built into.
#[derive(Debug, Clone)]
pub enum Build {
    /// The CPU decoder (`spotinfer_fused_cpu::CpuDecoder`), its dense layers in this precision,
    /// on the widest instructions the second allows.
    Cpu(Precision, CpuKernels),
    /// The paged decoder (`super::paged::decoder`) on a candle device, in a dtype, with a cache
    /// of so many token slots.
    Paged {
        /// Where it runs.
        device: Device,
        /// Its weights' and activations' dtype.
        dtype: candle_core::DType,
        /// Token slots of its KV cache.
        cache_tokens: usize,
    },
}

impl Build {
    /// The network from `dims` and the weights reader.
    fn network(
        &self,
        path: &Path,
        dims: DecoderDims,
        mut read: impl FnMut(&str, &[usize]) -> Result<Option<Weights>, FusedError>,
    ) -> Result<Network, ModelError> {
        match self {
            Self::Cpu(precision, kernels) => {
                crate::alloc::one_arena();
                Ok(Network::Cpu(Box::new(
                    CpuDecoder::load(dims, *precision, kernels.widest(), read)
                        .map_err(from_bert(path))?,
                )))
            }
            Self::Paged {
                device,
                dtype,
                cache_tokens,
            } => PagedDecoder::load(dims, device, *dtype, *cache_tokens, |name, shape| {
                read(name, shape).map(|w| w.map(Weights::into_f32))
            })
            .map(|d| Network::Paged(std::sync::Arc::new(d)))
            .map_err(|e| unsupported(path, e.to_string())),
        }
    }
}

/// Everything a generation model is made of.
pub struct Loaded {
    /// The network.
    pub decoder: Network,
    /// The model's tokenizer.
    pub tokenizer: Tokenizer,
    /// The chat template (Jinja), if the model has one.
    pub chat_template: Option<String>,
    /// The `bos_token` and `eos_token` strings the template may use.
    pub bos_token: Option<String>,
    /// See `bos_token`.
    pub eos_token: Option<String>,
    /// Whether a raw prompt starts with the BOS token (GGUF's `add_bos_token`; for a folder, the
    /// tokenizer's own post-processor decides).
    pub add_bos: Option<u32>,
    /// The tokens that end a generation.
    pub stop_ids: Vec<u32>,
    /// The files the weights came from, for the weights hash.
    pub weight_files: Vec<PathBuf>,
    /// The format in words, for logs (`GGUF Q4_1`, `safetensors BF16`).
    pub format: String,
}

/// Loads the model at `path` (a `.gguf` file or a transformers folder) into the network
/// `build` names.
pub fn load(path: &Path, build: &Build) -> Result<Loaded, ModelError> {
    if path.extension().is_some_and(|e| e == "gguf") {
        load_gguf(path, build)
    } else {
        load_folder(path, build)
    }
}

fn unsupported(path: &Path, message: impl Into<String>) -> ModelError {
    ModelError::Unsupported {
        path: path.to_path_buf(),
        message: message.into(),
    }
}

fn from_bert(path: &Path) -> impl Fn(FusedError) -> ModelError + '_ {
    move |e| unsupported(path, e.to_string())
}

fn load_gguf(path: &Path, build: &Build) -> Result<Loaded, ModelError> {
    let io = |source| ModelError::File {
        path: path.to_path_buf(),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let content =
        Content::read(&mut file).map_err(|e| unsupported(path, format!("not a GGUF file: {e}")))?;
    let meta = &content.metadata;
    let arch = meta_str(meta, "general.architecture").unwrap_or_default();
    if !["llama", "qwen2", "qwen3"].contains(&arch.as_str()) {
        return Err(unsupported(
            path,
            format!("GGUF architecture {arch:?}: spotinfer generates with llama, qwen2 and qwen3"),
        ));
    }
    if let Some(kind) = meta_str(meta, &format!("{arch}.rope.scaling.type")) {
        if kind != "none" {
            return Err(unsupported(
                path,
                format!("rotary scaling {kind:?} is not computed"),
            ));
        }
    }
    let num = |key: &str| meta_u64(meta, &format!("{arch}.{key}"));
    let need = |key: &str| {
        num(key).ok_or_else(|| unsupported(path, format!("GGUF metadata lacks {arch}.{key}")))
    };
    let tokenizer = gguf_tokenizer::from_metadata(meta).map_err(|e| unsupported(path, e))?;
    let vocab = tokenizer.get_vocab_size(true);
    let (hidden, heads) = (
        need("embedding_length")? as usize,
        need("attention.head_count")? as usize,
    );
    let dims = DecoderDims {
        layers: need("block_count")? as usize,
        hidden,
        heads,
        kv_heads: num("attention.head_count_kv").unwrap_or(heads as u64) as usize,
        head_dim: num("attention.key_length").map_or(hidden / heads.max(1), |v| v as usize),
        intermediate: need("feed_forward_length")? as usize,
        vocab,
        max_positions: need("context_length")? as usize,
        rope_theta: meta_f32(meta, &format!("{arch}.rope.freq_base")).unwrap_or(10_000.0),
        eps: meta_f32(meta, &format!("{arch}.attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
        qk_norm: arch == "qwen3",
        tied: !content.tensor_infos.contains_key("output.weight"),
    };
    let mut types = std::collections::BTreeSet::new();
    let decoder = build.network(path, dims, |name, shape| {
        let Some(gguf_name) = gguf_name(name) else {
            return Ok(None);
        };
        if !content.tensor_infos.contains_key(&gguf_name) {
            return Ok(None);
        }
        let t = content
            .tensor(&mut file, &gguf_name, &Device::Cpu)
            .map_err(|e| FusedError::Unsupported(format!("tensor {gguf_name}: {e}")))?;
        types.insert(format!("{:?}", t.dtype()));
        if t.shape().elem_count() != shape.iter().product::<usize>() {
            return Err(FusedError::Unsupported(format!(
                "tensor {gguf_name}: shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let read = gguf_weights(&t, shape)
            .map_err(|e| FusedError::Unsupported(format!("tensor {gguf_name}: {e}")))?;
        // llama.cpp stores a llama's query and key rows permuted for its interleaved rotary
        // embedding; the decoder rotates halves, as transformers does, so they are put back.
        let permuted = arch == "llama"
            && (gguf_name.ends_with("attn_q.weight") || gguf_name.ends_with("attn_k.weight"));
        Ok(Some(match read {
            Weights::F32(w) if permuted => Weights::F32(unpermute(&w, shape, dims.head_dim)),
            Weights::Blocks(m) if permuted => {
                Weights::Blocks(m.permute_rows(|r| unpermuted_row(r, dims.head_dim)))
            }
            other => other,
        }))
    })?;
    let token = |key: &str| meta_u64(meta, key).map(|v| v as u32);
    let text_of = |id: Option<u32>| id.and_then(|i| tokenizer.id_to_token(i));
    let bos = token("tokenizer.ggml.bos_token_id");
    let eos = token("tokenizer.ggml.eos_token_id");
    let add_bos = match meta.get("tokenizer.ggml.add_bos_token") {
        Some(Value::Bool(true)) => bos,
        _ => None,
    };
    let mut stop_ids: Vec<u32> = eos.into_iter().collect();
    stop_ids.extend(token("tokenizer.ggml.eot_token_id"));
    stop_ids.dedup();
    Ok(Loaded {
        chat_template: meta_str(meta, "tokenizer.chat_template"),
        bos_token: text_of(bos),
        eos_token: text_of(eos),
        add_bos,
        stop_ids,
        decoder,
        tokenizer,
        weight_files: vec![path.to_path_buf()],
        format: format!("GGUF {}", types.into_iter().collect::<Vec<_>>().join("+")),
    })
}

/// The GGUF name of a tensor transformers names `name`.
fn gguf_name(name: &str) -> Option<String> {
    let fixed = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight"),
        "model.norm.weight" => Some("output_norm.weight"),
        "lm_head.weight" => Some("output.weight"),
        _ => None,
    };
    if let Some(f) = fixed {
        return Some(f.into());
    }
    let rest = name.strip_prefix("model.layers.")?;
    let (layer, part) = rest.split_once('.')?;
    let part = match part {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.bias" => "attn_output.bias",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return None,
    };
    Some(format!("blk.{layer}.{part}"))
}

/// Undoes llama.cpp's permutation of a llama's query or key rows: within each head, its row
/// `2i + j` holds transformers' row `j · head_dim/2 + i`.
fn unpermute(w: &[f32], shape: &[usize], head_dim: usize) -> Vec<f32> {
    let cols = shape.get(1).copied().unwrap_or(1);
    let mut out = vec![0f32; w.len()];
    for (r, row) in w.chunks_exact(cols).enumerate() {
        let to = unpermuted_row(r, head_dim);
        out[to * cols..][..cols].copy_from_slice(row);
    }
    out
}

/// Where [`unpermute`] puts llama.cpp's row `r`.
fn unpermuted_row(r: usize, head_dim: usize) -> usize {
    let (head, within) = (r / head_dim, r % head_dim);
    let (i, j) = (within / 2, within % 2);
    head * head_dim + j * (head_dim / 2) + i
}

/// A GGUF tensor as the decoder takes it: a matrix in a block format the CPU decoder
/// multiplies, as its bytes; anything else widened to f32 by candle.
fn gguf_weights(t: &QTensor, shape: &[usize]) -> candle_core::Result<Weights> {
    let format = match t.dtype() {
        GgmlDType::Q4_0 => Some(BlockFormat::Q4_0),
        GgmlDType::Q4_1 => Some(BlockFormat::Q4_1),
        GgmlDType::Q5_0 => Some(BlockFormat::Q5_0),
        GgmlDType::Q5_1 => Some(BlockFormat::Q5_1),
        GgmlDType::Q8_0 => Some(BlockFormat::Q8_0),
        GgmlDType::Q4K => Some(BlockFormat::Q4K),
        GgmlDType::Q5K => Some(BlockFormat::Q5K),
        GgmlDType::Q6K => Some(BlockFormat::Q6K),
        _ => None,
    };
    if let (Some(format), [rows, k]) = (format, shape) {
        let bytes = t.data()?.into_owned();
        return BlockMatrix::new(format, *rows, *k, bytes)
            .map(Weights::Blocks)
            .map_err(candle_core::Error::msg);
    }
    let values = t
        .dequantize(&Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?;
    Ok(Weights::F32(values))
}

fn meta_str(meta: &HashMap<String, Value>, key: &str) -> Option<String> {
    match meta.get(key)? {
        Value::String(s) => Some(s.clone()),
        _ => None,
    }
}

fn meta_u64(meta: &HashMap<String, Value>, key: &str) -> Option<u64> {
    match meta.get(key)? {
        Value::U8(v) => Some(u64::from(*v)),
        Value::U16(v) => Some(u64::from(*v)),
        Value::U32(v) => Some(u64::from(*v)),
        Value::U64(v) => Some(*v),
        Value::I32(v) => u64::try_from(*v).ok(),
        Value::I64(v) => u64::try_from(*v).ok(),
        _ => None,
    }
}

fn meta_f32(meta: &HashMap<String, Value>, key: &str) -> Option<f32> {
    match meta.get(key)? {
        Value::F32(v) => Some(*v),
        Value::F64(v) => Some(*v as f32),
        _ => None,
    }
}

fn read_json(path: &Path) -> Result<Json, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|source| ModelError::File {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|e| ModelError::Config {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// The architectures a folder may hold, and whether each has per-head q/k norms.
const ARCHITECTURES: [(&str, bool); 3] = [
    ("LlamaForCausalLM", false),
    ("Qwen2ForCausalLM", false),
    ("Qwen3ForCausalLM", true),
];

/// The decoder's shape from a transformers `config.json`, refusing what it would compute
/// differently.
fn folder_dims(path: &Path, c: &Json) -> Result<DecoderDims, ModelError> {
    let arch = c["architectures"][0].as_str().unwrap_or_default();
    let Some(&(_, qk_norm)) = ARCHITECTURES.iter().find(|(a, _)| *a == arch) else {
        return Err(unsupported(
            path,
            format!(
                "architecture {arch:?}: spotinfer generates with {}",
                ARCHITECTURES.map(|a| a.0).join(", ")
            ),
        ));
    };
    let act = c["hidden_act"].as_str().unwrap_or("silu");
    if act != "silu" {
        return Err(unsupported(
            path,
            format!("hidden_act {act:?}: the decoder computes silu"),
        ));
    }
    if c["mlp_bias"].as_bool() == Some(true) {
        return Err(unsupported(
            path,
            "mlp_bias: the feed-forward layers have no biases here",
        ));
    }
    if c["use_sliding_window"].as_bool() == Some(true)
        || c["layer_types"]
            .as_array()
            .is_some_and(|l| l.iter().any(|t| t != "full_attention"))
    {
        return Err(unsupported(
            path,
            "sliding-window attention is not computed",
        ));
    }
    let rope = c.get("rope_parameters").filter(|r| !r.is_null());
    let scaling = rope.map_or(&c["rope_scaling"], |r| r);
    let kind = scaling["rope_type"]
        .as_str()
        .or(scaling["type"].as_str())
        .unwrap_or("default");
    if !scaling.is_null() && kind != "default" {
        return Err(unsupported(
            path,
            format!("rotary scaling {kind:?} is not computed"),
        ));
    }
    let theta = rope
        .and_then(|r| r["rope_theta"].as_f64())
        .or(c["rope_theta"].as_f64())
        .unwrap_or(10_000.0);
    let int = |key: &str| c[key].as_u64().map(|v| v as usize);
    let need = |key: &str| {
        int(key).ok_or_else(|| ModelError::Config {
            path: path.join("config.json"),
            message: format!("no {key}"),
        })
    };
    let (hidden, heads) = (need("hidden_size")?, need("num_attention_heads")?);
    Ok(DecoderDims {
        layers: need("num_hidden_layers")?,
        hidden,
        heads,
        kv_heads: int("num_key_value_heads").unwrap_or(heads),
        head_dim: int("head_dim").unwrap_or(hidden / heads.max(1)),
        intermediate: need("intermediate_size")?,
        vocab: need("vocab_size")?,
        max_positions: need("max_position_embeddings")?,
        rope_theta: theta as f32,
        eps: c["rms_norm_eps"].as_f64().unwrap_or(1e-6) as f32,
        qk_norm,
        tied: c["tie_word_embeddings"].as_bool().unwrap_or(false),
    })
}

/// A transformers folder's weights, read by the names transformers gives them, as f32 of the
/// shape the decoder asks for: what the CPU decoder and the paged one are built from.
pub(super) struct FolderWeights {
    tensors: candle_core::safetensors::MmapedSafetensors,
    /// The safetensors files, in order.
    pub files: Vec<PathBuf>,
    /// The dtypes read, for the format's description.
    pub dtypes: std::collections::BTreeSet<String>,
}

impl FolderWeights {
    /// The folder's `config.json` (parsed), the decoder's shape from it, and its weights.
    pub(super) fn open(dir: &Path) -> Result<(Json, DecoderDims, Self), ModelError> {
        let config = read_json(&dir.join("config.json"))?;
        let dims = folder_dims(dir, &config)?;
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|source| ModelError::File {
                path: dir.to_path_buf(),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(unsupported(dir, "no .safetensors weights"));
        }
        // SAFETY: the files are not written while a worker loads them (see fused-cpu's weights).
        let tensors = unsafe { candle_core::safetensors::MmapedSafetensors::multi(&files) }?;
        let weights = Self {
            tensors,
            files,
            dtypes: Default::default(),
        };
        Ok((config, dims, weights))
    }

    /// Tensor `name` as f32 values, checked to be `shape`; `None` when the files lack it.
    pub(super) fn read(
        &mut self,
        name: &str,
        shape: &[usize],
    ) -> Result<Option<Vec<f32>>, FusedError> {
        let Ok(view) = self.tensors.get(name) else {
            return Ok(None);
        };
        if view.shape() != shape {
            return Err(FusedError::Unsupported(format!(
                "tensor {name}: shape {:?}, expected {shape:?}",
                view.shape()
            )));
        }
        self.dtypes.insert(format!("{:?}", view.dtype()));
        self.tensors
            .load(name, &Device::Cpu)
            .and_then(|t| {
                t.to_dtype(candle_core::DType::F32)?
                    .flatten_all()?
                    .to_vec1::<f32>()
            })
            .map(Some)
            .map_err(|e| FusedError::Unsupported(format!("tensor {name}: {e}")))
    }
}

fn load_folder(dir: &Path, build: &Build) -> Result<Loaded, ModelError> {
    let (config, dims, mut weights) = FolderWeights::open(dir)?;
    let decoder = build.network(dir, dims, |name, shape| {
        Ok(weights.read(name, shape)?.map(Weights::F32))
    })?;
    let (files, dtypes) = (weights.files, weights.dtypes);
    let tokenizer = Tokenizer::from_file(dir.join("tokenizer.json"))
        .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
    let tok_config = read_json(&dir.join("tokenizer_config.json")).unwrap_or(Json::Null);
    let chat_template = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
        Ok(t) => Some(t),
        Err(_) => template_of(&tok_config["chat_template"]),
    };
    let special = |key: &str| match &tok_config[key] {
        Json::String(s) => Some(s.clone()),
        v => v["content"].as_str().map(str::to_owned),
    };
    let generation = read_json(&dir.join("generation_config.json")).unwrap_or(Json::Null);
    let eos = if generation["eos_token_id"].is_null() {
        &config["eos_token_id"]
    } else {
        &generation["eos_token_id"]
    };
    let mut stop_ids: Vec<u32> = match eos {
        Json::Array(a) => a
            .iter()
            .filter_map(Json::as_u64)
            .map(|v| v as u32)
            .collect(),
        v => v.as_u64().map(|v| v as u32).into_iter().collect(),
    };
    if stop_ids.is_empty() {
        stop_ids.extend(special("eos_token").and_then(|t| tokenizer.token_to_id(&t)));
    }
    Ok(Loaded {
        decoder,
        chat_template,
        bos_token: special("bos_token"),
        eos_token: special("eos_token"),
        add_bos: None,
        stop_ids,
        tokenizer,
        weight_files: files,
        format: format!(
            "safetensors {}",
            dtypes.into_iter().collect::<Vec<_>>().join("+")
        ),
    })
}

/// A `tokenizer_config.json` chat template: a string, or the one named `default` of a list.
fn template_of(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Array(list) => list
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_owned),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Tensor;

    /// The CPU decoder reads each block format's bytes itself (its f32 path widens them, its
    /// GGUF path multiplies them): what it reads must be what llama.cpp's dequantisation gives,
    /// which candle's reproduces. Each format, quantised by candle from the same values, widens
    /// to candle's f32 bit for bit.
    #[test]
    fn each_block_format_widens_to_candles_values_bit_for_bit() {
        let (rows, k) = (6, 512);
        let values: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * (1.0 + (i % 37) as f32))
            .collect();
        let t = Tensor::from_vec(values, (rows, k), &Device::Cpu).unwrap();
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let q = QTensor::quantize(&t, dtype).unwrap();
            let theirs: Vec<f32> = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let Weights::Blocks(m) = gguf_weights(&q, &[rows, k]).unwrap() else {
                panic!("{dtype:?} was not kept in blocks");
            };
            let ours = m.dequantize();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(&ours), bits(&theirs), "{dtype:?}");
        }
        // A format the decoder does not multiply is widened by candle.
        let q = QTensor::quantize(&t, GgmlDType::Q3K).unwrap();
        assert!(matches!(
            gguf_weights(&q, &[rows, k]).unwrap(),
            Weights::F32(_)
        ));
    }
}
