//! The paged KV cache's bookkeeping, on the host (issue 52): the device holds one pool of
//! blocks of `block_size` token slots for every layer's keys and values; this hands blocks to
//! sequences and takes them back, and says where each new token's key and value go (its slot)
//! and which blocks a sequence reads (its block table). No device memory is touched here, so the
//! whole of it is tested on the CPU.
//!
//! A sequence's blocks are all taken when it is admitted, for its prompt and its most new tokens:
//! a running sequence never waits for a block, so nothing is ever preempted and recomputed (and
//! a step's batch never depends on how full the pool is, which keeps resumption exact). What that
//! costs is concurrency when answers end well before their limit; vLLM takes blocks as sequences
//! grow and preempts instead.

use std::collections::HashMap;

/// A sequence's id in the pool (the scheduler's).
pub type SeqId = u64;

/// Why a sequence could not be admitted or grown.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not enough free blocks now; the sequence waits for others to end.
    #[error("{needed} blocks needed, {free} free")]
    Full {
        /// Blocks the sequence needs.
        needed: usize,
        /// Blocks free.
        free: usize,
    },
    /// More blocks than the whole pool holds: it can never run.
    #[error("{needed} blocks needed, the pool holds {total}")]
    TooLarge {
        /// Blocks the sequence needs.
        needed: usize,
        /// Blocks in the pool.
        total: usize,
    },
    /// A sequence admitted twice, or one the pool does not know.
    #[error("sequence {0}: {1}")]
    Misuse(SeqId, &'static str),
    /// Tokens past what the sequence was admitted for.
    #[error("sequence {seq}: {len} tokens past the {capacity} it was admitted for")]
    PastCapacity {
        /// The sequence.
        seq: SeqId,
        /// The length it would reach.
        len: usize,
        /// Its blocks' slots.
        capacity: usize,
    },
}

/// A sequence's blocks, in order, and how many of their slots hold tokens.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Table {
    blocks: Vec<u32>,
    len: usize,
}

/// The pool of blocks and the sequences holding them.
#[derive(Debug)]
pub struct BlockPool {
    block_size: usize,
    total: usize,
    /// Free blocks, the lowest id on top (taken first), so a run's layout does not depend on
    /// the order sequences ended in more than it must.
    free: Vec<u32>,
    tables: HashMap<SeqId, Table>,
}

impl BlockPool {
    /// A pool of `blocks` blocks of `block_size` slots.
    pub fn new(blocks: usize, block_size: usize) -> Self {
        Self {
            block_size: block_size.max(1),
            total: blocks,
            free: (0..blocks as u32).rev().collect(),
            tables: HashMap::new(),
        }
    }

    /// The pool an operator's memory budget allows: `budget_bytes` over what one block takes
    /// on the device, keys and values of every layer (`bytes_per_token` for one token slot).
    pub fn for_budget(budget_bytes: usize, bytes_per_token: usize, block_size: usize) -> Self {
        let per_block = bytes_per_token.max(1) * block_size.max(1);
        Self::new(budget_bytes / per_block, block_size)
    }

    /// Slots a block holds.
    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.total
    }

    /// Blocks no sequence holds.
    pub fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks a sequence of `tokens` tokens needs.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Admits `seq` for at most `tokens` tokens (its prompt and its most new tokens), taking
    /// every block it will need now; an error leaves the pool as it was.
    pub fn admit(&mut self, seq: SeqId, tokens: usize) -> Result<(), PoolError> {
        if self.tables.contains_key(&seq) {
            return Err(PoolError::Misuse(seq, "admitted twice"));
        }
        let needed = self.blocks_for(tokens);
        if needed > self.total {
            return Err(PoolError::TooLarge {
                needed,
                total: self.total,
            });
        }
        if needed > self.free.len() {
            return Err(PoolError::Full {
                needed,
                free: self.free.len(),
            });
        }
        let at = self.free.len() - needed;
        let mut blocks = self.free.split_off(at);
        blocks.reverse();
        self.tables.insert(seq, Table { blocks, len: 0 });
        Ok(())
    }

    /// Appends `tokens` tokens to `seq`: the slot (block × block_size + offset) each one's key
    /// and value are written to, in order.
    pub fn append(&mut self, seq: SeqId, tokens: usize) -> Result<Vec<u32>, PoolError> {
        let size = self.block_size;
        let table = self
            .tables
            .get_mut(&seq)
            .ok_or(PoolError::Misuse(seq, "not admitted"))?;
        let capacity = table.blocks.len() * size;
        if table.len + tokens > capacity {
            return Err(PoolError::PastCapacity {
                seq,
                len: table.len + tokens,
                capacity,
            });
        }
        let slots = (table.len..table.len + tokens)
            .map(|p| table.blocks[p / size] * size as u32 + (p % size) as u32)
            .collect();
        table.len += tokens;
        Ok(slots)
    }

    /// Tokens `seq` holds.
    pub fn len(&self, seq: SeqId) -> Option<usize> {
        self.tables.get(&seq).map(|t| t.len)
    }

    /// `seq`'s blocks, in order (the first `len(seq)` slots of them hold its tokens).
    pub fn table(&self, seq: SeqId) -> Option<&[u32]> {
        self.tables.get(&seq).map(|t| t.blocks.as_slice())
    }

    /// The block tables of `seqs` as one row-major matrix, each row padded with zeros to the
    /// longest (a padded entry is never read: a row is read up to its sequence's length), and
    /// the rows' width.
    pub fn table_matrix(&self, seqs: &[SeqId]) -> Result<(Vec<u32>, usize), PoolError> {
        let tables = seqs
            .iter()
            .map(|&s| self.table(s).ok_or(PoolError::Misuse(s, "not admitted")))
            .collect::<Result<Vec<_>, _>>()?;
        let width = tables.iter().map(|t| t.len()).max().unwrap_or(0).max(1);
        let mut matrix = vec![0u32; width * tables.len()];
        for (row, t) in matrix.chunks_mut(width).zip(&tables) {
            row[..t.len()].copy_from_slice(t);
        }
        Ok((matrix, width))
    }

    /// Gives `seq`'s blocks back (a sequence that ended, or was interrupted and checkpointed).
    pub fn release(&mut self, seq: SeqId) {
        if let Some(t) = self.tables.remove(&seq) {
            self.free.extend(t.blocks);
            // The lowest ids on top again.
            self.free.sort_unstable_by(|a, b| b.cmp(a));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{BlockPool, PoolError};
    use std::collections::HashSet;

    /// Slots follow the block table: a sequence's tokens fill its blocks in order, no two
    /// sequences ever share a slot, and the matrix of tables holds each table as its row.
    #[test]
    fn slots_follow_the_block_table_and_are_never_shared() {
        let mut pool = BlockPool::new(10, 4);
        pool.admit(1, 9).unwrap(); // 3 blocks
        pool.admit(2, 4).unwrap(); // 1 block
        assert_eq!(pool.free(), 6);
        let mut seen = HashSet::new();
        for (seq, chunks) in [(1u64, vec![5usize, 1, 3]), (2, vec![1, 1, 2])] {
            let mut slots = vec![];
            for n in chunks {
                slots.extend(pool.append(seq, n).unwrap());
            }
            let table = pool.table(seq).unwrap().to_vec();
            for (p, slot) in slots.iter().enumerate() {
                assert_eq!(
                    *slot,
                    table[p / 4] * 4 + (p % 4) as u32,
                    "seq {seq} token {p}"
                );
                assert!(seen.insert(*slot), "slot {slot} given twice");
            }
        }
        let (matrix, width) = pool.table_matrix(&[2, 1]).unwrap();
        assert_eq!(width, 3);
        assert_eq!(&matrix[..1], pool.table(2).unwrap());
        assert_eq!(&matrix[3..], pool.table(1).unwrap());
    }

    /// A sequence is admitted whole or not at all: past the free blocks it waits (`Full`, the
    /// pool unchanged), past the pool it is refused (`TooLarge`), and past its own capacity its
    /// tokens are refused; released blocks are taken again, lowest first.
    #[test]
    fn admission_is_all_or_nothing_and_blocks_come_back() {
        let mut pool = BlockPool::new(4, 16);
        pool.admit(1, 40).unwrap(); // 3 blocks
        assert_eq!(
            pool.admit(2, 20),
            Err(PoolError::Full { needed: 2, free: 1 })
        );
        assert_eq!(pool.free(), 1);
        assert_eq!(
            pool.admit(3, 65),
            Err(PoolError::TooLarge {
                needed: 5,
                total: 4
            })
        );
        assert!(matches!(pool.admit(1, 1), Err(PoolError::Misuse(1, _))));
        pool.append(1, 48).unwrap();
        assert!(matches!(
            pool.append(1, 1),
            Err(PoolError::PastCapacity { capacity: 48, .. })
        ));
        assert_eq!(pool.table(1).unwrap(), [0, 1, 2]);
        pool.release(1);
        assert_eq!(pool.free(), 4);
        pool.admit(2, 20).unwrap();
        assert_eq!(pool.table(2).unwrap(), [0, 1]);
        assert_eq!(pool.len(1), None);
    }

    /// The budget sizes the pool: SmolLM2-135M's keys and values in bf16 (30 layers, 3 KV heads
    /// of 64, two tensors: 23,040 bytes a token) in 1 GiB, 16 tokens a block.
    #[test]
    fn the_memory_budget_sizes_the_pool() {
        let bytes_per_token = 30 * 3 * 64 * 2 * 2;
        let pool = BlockPool::for_budget(1 << 30, bytes_per_token, 16);
        assert_eq!(pool.total(), (1usize << 30) / (bytes_per_token * 16));
        assert_eq!(pool.total(), 2912);
    }
}
