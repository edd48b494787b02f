//! Reading the encoder's weights from a safetensors file: the file is memory-mapped, parsed by
//! the `safetensors` crate, and each tensor is copied once into its final f32 buffer (f16 and
//! bf16 files are widened on the way), so the weights exist once in memory.

use crate::FusedError;
use safetensors::{Dtype, SafeTensors};
use std::path::{Path, PathBuf};

/// A mapped safetensors file.
pub(crate) struct WeightsFile {
    path: PathBuf,
    map: memmap2::Mmap,
}

/// The parsed header of a [`WeightsFile`], to read tensors from.
pub(crate) struct Tensors<'a> {
    path: &'a Path,
    st: SafeTensors<'a>,
}

impl WeightsFile {
    /// Maps the file.
    pub(crate) fn open(path: &Path) -> Result<Self, FusedError> {
        let io = |source| FusedError::File {
            path: path.to_path_buf(),
            source,
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read while the model loads and dropped after; the model files are
        // not written while a worker loads them (the Cloud Storage cache verifies and then only
        // renames complete files into place).
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Ok(Self {
            path: path.to_path_buf(),
            map,
        })
    }

    /// Parses the header.
    pub(crate) fn tensors(&self) -> Result<Tensors<'_>, FusedError> {
        let st = SafeTensors::deserialize(&self.map).map_err(|e| FusedError::Weights {
            path: self.path.clone(),
            message: format!("not a safetensors file: {e}"),
        })?;
        Ok(Tensors {
            path: &self.path,
            st,
        })
    }
}

impl Tensors<'_> {
    /// An error about this file.
    pub(crate) fn error(&self, message: String) -> FusedError {
        FusedError::Weights {
            path: self.path.to_path_buf(),
            message,
        }
    }

    /// Whether the file has a tensor of this name.
    pub(crate) fn has(&self, name: &str) -> bool {
        self.st.tensor(name).is_ok()
    }

    /// The tensor `name` as f32, checked to have exactly `shape`.
    pub(crate) fn read(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, FusedError> {
        let t = self
            .st
            .tensor(name)
            .map_err(|_| self.error(format!("no tensor {name}")))?;
        if t.shape() != shape {
            return Err(self.error(format!(
                "tensor {name}: shape {:?}, expected {shape:?}",
                t.shape()
            )));
        }
        let bytes = t.data();
        let out = match t.dtype() {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::F16 => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => {
                return Err(self.error(format!(
                    "tensor {name}: {other:?}; expected F32, F16 or BF16"
                )))
            }
        };
        Ok(out)
    }
}
