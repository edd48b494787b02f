//! The one error type of the crate's networks: loading weights or running a network.

/// Errors loading weights or running the encoder.
#[derive(Debug, thiserror::Error)]
pub enum FusedError {
    /// The weights file cannot be read.
    #[error("cannot read model file {path}: {source}")]
    File {
        /// The file.
        path: std::path::PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The weights file is not the model the config describes.
    #[error("invalid weights {path}: {message}")]
    Weights {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A batch the encoder cannot take (a tokenizer for another model, say).
    #[error("invalid model input: {0}")]
    Input(String),
    /// A precision this CPU or this encoder cannot compute in.
    #[error("{0}")]
    Unsupported(String),
}
