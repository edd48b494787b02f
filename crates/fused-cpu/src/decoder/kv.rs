//! One sequence's keys and values ([`KvCache`]), every layer, every position so far.
//!
//! They are kept in f32, or in f16 where the dense layers are a GGUF's blocks
//! ([`crate::Precision::Gguf`]), as llama.cpp keeps them by default: a decoding step's attention
//! reads every sequence's whole cache, far more than the core's caches hold (32 sequences of a
//! Qwen2.5-0.5B shape at 150 positions: 110 MiB in f32), so half the bytes is most of
//! attention's time at long prompts, and half the memory a sequence holds. A key or value is
//! rounded to the nearest f16 once, when it is stored, and every later read widens it exactly,
//! so a sequence still reads the same numbers alone, batched, read whole or resumed.

use super::attend::{KvHead, Rows};
use half::f16;

/// One layer's keys and values: rows of `kv_dim`, one a position.
#[derive(Debug, Clone)]
enum Layer {
    F32 { keys: Vec<f32>, values: Vec<f32> },
    F16 { keys: Vec<f16>, values: Vec<f16> },
}

/// One sequence's keys and values, every layer, every position so far (empty for a new one).
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    pub(super) len: usize,
    layers: Vec<Layer>,
}

impl KvCache {
    /// Positions held.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether its keys and values are held in f16.
    pub fn is_f16(&self) -> bool {
        matches!(self.layers.first(), Some(Layer::F16 { .. }))
    }

    /// A copy of its first `len` positions (all of them if it holds fewer): the keys and values
    /// of a prompt prefix, for another sequence that starts with the same tokens (a position's
    /// keys and values depend only on the tokens up to it).
    pub fn prefix(&self, len: usize) -> KvCache {
        let len = len.min(self.len);
        fn cut<T: Clone>(rows: &[T], len: usize, of: usize) -> Vec<T> {
            rows[..rows.len() / of.max(1) * len].to_vec()
        }
        let layers = self
            .layers
            .iter()
            .map(|layer| match layer {
                Layer::F32 { keys, values } => Layer::F32 {
                    keys: cut(keys, len, self.len),
                    values: cut(values, len, self.len),
                },
                Layer::F16 { keys, values } => Layer::F16 {
                    keys: cut(keys, len, self.len),
                    values: cut(values, len, self.len),
                },
            })
            .collect();
        KvCache { len, layers }
    }

    /// Gives a new cache its `layers` in f16 or f32; `Err` with the reason for a cache that holds
    /// the other type (one made by a decoder of another precision).
    pub(super) fn prepare(&mut self, layers: usize, in_f16: bool) -> Result<(), String> {
        if self.layers.is_empty() {
            let empty = || match in_f16 {
                true => Layer::F16 {
                    keys: Vec::new(),
                    values: Vec::new(),
                },
                false => Layer::F32 {
                    keys: Vec::new(),
                    values: Vec::new(),
                },
            };
            self.layers = (0..layers).map(|_| empty()).collect();
        }
        if self.layers.len() != layers || self.is_f16() != in_f16 {
            return Err(format!(
                "a cache of {} layers in {} given to a decoder of {layers} in {}",
                self.layers.len(),
                if self.is_f16() { "f16" } else { "f32" },
                if in_f16 { "f16" } else { "f32" }
            ));
        }
        Ok(())
    }

    /// Appends one position's key and value to layer `l`, with room made for the `coming`
    /// positions the step still appends there ([`grow`]).
    pub(super) fn push(&mut self, l: usize, key: &[f32], value: &[f32], coming: usize) {
        match &mut self.layers[l] {
            Layer::F32 { keys, values } => {
                for (rows, row) in [(keys, key), (values, value)] {
                    grow(rows, row.len(), coming);
                    rows.extend_from_slice(row);
                }
            }
            Layer::F16 { keys, values } => {
                use half::slice::HalfFloatSliceExt;
                for (rows, row) in [(keys, key), (values, value)] {
                    grow(rows, row.len(), coming);
                    let at = rows.len();
                    rows.resize(at + row.len(), f16::ZERO);
                    rows[at..].convert_from_f32_slice(row);
                }
            }
        }
    }

    /// Layer `l`'s keys and values of one key/value head (at `offset` in each row of
    /// `kv_dim`), its first `len` positions, for attention.
    pub(super) fn head(&self, l: usize, len: usize, kv_dim: usize, offset: usize) -> KvHead<'_> {
        match &self.layers[l] {
            Layer::F32 { keys, values } => KvHead::F32(Rows {
                keys,
                values,
                len,
                kv_dim,
                offset,
            }),
            Layer::F16 { keys, values } => KvHead::F16(Rows {
                keys,
                values,
                len,
                kv_dim,
                offset,
            }),
        }
    }
}

/// Makes room for the `coming` positions a step still appends to a layer's keys or values (a
/// prompt's part at once; one when decoding), growing by an eighth of what it holds (at least
/// 16 positions) rather than by `Vec`'s doubling, which left up to half of each allocated and
/// unused: batch 32 of SmolLM2 Q4_1 (64 new tokens, 195 MiB of keys and values held at the end)
/// peaked at 386 MiB that way, 340 MiB this way. Allocating each sequence's layers once at its
/// planned length was tried and peaked higher (352 MiB): answers that end early leave their
/// planned room to the heap in pieces. A prompt's part was grown 16 positions at a time until
/// 2026-11-29, each a new allocation and a freed one: taken at once, the Qwen2.5-0.5B shape at
/// 32 peaked 3–4 MiB lower (547.6–548.0 MiB against 550.7–551.7, three alternated runs).
fn grow<T>(layer: &mut Vec<T>, width: usize, coming: usize) {
    if layer.capacity() - layer.len() < coming * width {
        let positions = (layer.len() / width / 8).max(16).max(coming);
        layer.reserve_exact(positions * width);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An f16 cache stores each number rounded to the nearest f16, keeps its type through a
    /// prefix, and refuses to be used as an f32 one (or with another layer count).
    #[test]
    fn an_f16_cache_rounds_once_keeps_its_type_and_refuses_the_other() {
        let mut cache = KvCache::default();
        cache.prepare(2, true).expect("new cache");
        let (key, value) = (
            [0.1f32, -3.3, 65_519.0, 1e-8],
            [1.0f32 / 3.0, 7.77, -0.0, 2.5],
        );
        for position in 0..3 {
            for l in 0..2 {
                let shift = position as f32;
                let k: Vec<f32> = key.iter().map(|x| x + shift).collect();
                cache.push(l, &k, &value, 3 - position);
            }
            cache.len += 1;
        }
        assert!(cache.is_f16());
        let KvHead::F16(rows) = cache.head(1, 3, 4, 0) else {
            panic!("an f16 cache gave f32 rows");
        };
        let expected: Vec<f16> = (0..3)
            .flat_map(|p| key.iter().map(move |x| f16::from_f32(x + p as f32)))
            .collect();
        assert_eq!(rows.keys, &expected[..]);
        assert_eq!(rows.values[4..8], value.map(f16::from_f32));
        let prefix = cache.prefix(2);
        assert_eq!((prefix.len(), prefix.is_f16()), (2, true));
        let KvHead::F16(cut) = prefix.head(0, 2, 4, 0) else {
            panic!("a prefix changed type");
        };
        assert_eq!(cut.keys, &expected[..8]);
        assert!(cache.prepare(2, false).is_err());
        assert!(cache.prepare(3, true).is_err());
        let mut f32_cache = KvCache::default();
        f32_cache.prepare(2, false).expect("new cache");
        assert!(!f32_cache.is_f16());
    }
}
