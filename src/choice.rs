//! Settings picked by name from a fixed list (`--device cuda`, `SPOTINFER_PRECISION=bf16`).
//!
//! The domain enums (the model's device, backend and precision; the log format) implement
//! [`Choice`] where they live, so the layers that use them need no command-line crate; the CLI
//! (`config`) turns any `Choice` into a parser that lists the names in `--help` and refuses
//! others, once for all of them.

/// An enum whose values are chosen by name.
pub trait Choice: Sized + Copy + Send + Sync + 'static {
    /// Every value with the name that picks it, in the order `--help` lists them.
    const NAMES: &'static [(&'static str, Self)];

    /// The value `name` picks.
    fn from_name(name: &str) -> Option<Self> {
        Self::NAMES
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|&(_, v)| v)
    }
}
