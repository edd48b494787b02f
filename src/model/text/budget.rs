//! Encoder batches formed by a token budget rather than a count.
//!
//! A padded encoder (candle, on CUDA) computes `texts × longest` token positions, and its memory
//! grows with that product (attention scores with its square). A fixed count of texts is either
//! too small for short texts (the GPU idles) or too large for long ones (memory spikes). So the
//! model splits each batch it is handed into encoder batches whose padded size stays within
//! `--max-batch-tokens`: shortest texts first, as many as fit.

/// Groups of indices into `lens`, shortest first, each group's `len × longest` at most `budget`
/// (a text longer than the budget alone makes a group of one). `budget` 0 means no limit.
pub fn token_budget_chunks(lens: &[usize], budget: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| lens[i]);
    let mut chunks: Vec<Vec<usize>> = Vec::new();
    let mut current: Vec<usize> = Vec::new();
    for i in order {
        // Sorted ascending, so the text being added is the group's longest.
        let padded = (current.len() + 1) * lens[i];
        if !current.is_empty() && budget > 0 && padded > budget {
            chunks.push(std::mem::take(&mut current));
        }
        current.push(i);
    }
    if !current.is_empty() {
        chunks.push(current);
    }
    chunks
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_stay_within_the_budget_and_cover_every_text_once() {
        let lens = [10, 200, 3, 50, 50, 256, 7, 120, 1, 64];
        for budget in [0, 1, 64, 256, 300, 1000, 100_000] {
            let chunks = token_budget_chunks(&lens, budget);
            let mut seen: Vec<usize> = chunks.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>(), "budget {budget}");
            for c in &chunks {
                let longest = c.iter().map(|&i| lens[i]).max().unwrap();
                assert!(
                    budget == 0 || c.len() == 1 || c.len() * longest <= budget,
                    "budget {budget}: {c:?}"
                );
            }
        }
        assert_eq!(token_budget_chunks(&lens, 0).len(), 1);
        // 300 tokens: 1, 3, 7, 10, 50 and 50 fit as 6 × 50; 64 starts the next group.
        assert_eq!(token_budget_chunks(&lens, 300)[0], vec![8, 2, 6, 0, 3, 4]);
        assert_eq!(token_budget_chunks(&lens, 300)[1], vec![9, 7]);
    }
}
