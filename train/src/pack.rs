//! Packing a step's sequences into micro-batches for `--packing`: first-fit decreasing by token count,
//! each pack at most `--max-seq-len` tokens, and each pack one forward with the sequences back to back
//! (askgui-model's `StepOptions::pack`: block-diagonal causal attention, every sequence at its own M-RoPE
//! positions). Only the grouping changes: a step still takes the same sequences in the same data order,
//! so its loss and gradient are those of the unpacked step, without computing any padding.
//!
//! First-fit decreasing uses at most 11/9 OPT + 6/9 packs (Dósa, 2007); a step holds a few dozen
//! sequences, so the quadratic scan is nothing next to one forward.

/// Groups sequences of lengths `lens` into packs of at most `cap` tokens: indices into `lens`, longest
/// first, each pack in placing order. A sequence longer than `cap` gets a pack of its own (the data
/// loader already cuts every sample to `--max-seq-len`). Deterministic: ties keep the input order.
pub fn first_fit_decreasing(lens: &[usize], cap: usize) -> Vec<Vec<usize>> {
    let (mut packs, mut room): (Vec<Vec<usize>>, Vec<usize>) = (vec![], vec![]);
    for i in longest_first(lens) {
        match room.iter().position(|&r| r >= lens[i]) {
            Some(p) => {
                packs[p].push(i);
                room[p] -= lens[i];
            }
            None => {
                packs.push(vec![i]);
                room.push(cap.saturating_sub(lens[i]));
            }
        }
    }
    packs
}

/// Spreads sequences of lengths `lens` over `n` packs of near-equal token counts: longest first, each into
/// the lightest pack so far (Graham's LPT rule: the heaviest pack is within 4/3 of the best split). For
/// `--micro-batch-threads`, whose packs run at once. `None` when a pack would pass `cap`. Empty packs
/// (fewer sequences than `n`) are left out.
pub fn balanced(lens: &[usize], n: usize, cap: usize) -> Option<Vec<Vec<usize>>> {
    let mut packs = vec![(0usize, Vec::new()); n.max(1)];
    for i in longest_first(lens) {
        let lightest = packs.iter_mut().min_by_key(|p| p.0).expect("n >= 1");
        lightest.0 += lens[i];
        lightest.1.push(i);
    }
    let fits = packs.iter().all(|p| p.0 <= cap);
    fits.then(|| packs.into_iter().map(|p| p.1).filter(|p| !p.is_empty()).collect())
}

/// Indices into `lens`, longest first; ties keep the input order (a stable sort).
fn longest_first(lens: &[usize]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    order
}

/// The decoder rows a micro-batch of sequences of `lens` computes: all of them back to back when
/// packed, else each padded to the longest.
pub fn computed_rows(lens: &[usize], packed: bool) -> usize {
    match packed {
        true => lens.iter().sum(),
        false => lens.len() * lens.iter().copied().max().unwrap_or(0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packs_fit_hold_every_sequence_once_and_fill_first_fit() {
        // Sorted: 7 (0), 5 (2), 4 (4), 3 (1), 3 (5), 2 (3), 1 (6). Cap 10: 7 opens A (room 3), 5 opens B
        // (5), 4 goes to B (1), 3 (1) to A (0), 3 (5) opens C (7), 2 to C (5), 1 to B (0).
        let lens = [7, 3, 5, 2, 4, 3, 1];
        let packs = first_fit_decreasing(&lens, 10);
        assert_eq!(packs, vec![vec![0, 1], vec![2, 4, 6], vec![5, 3]]);
        let mut all: Vec<usize> = packs.concat();
        all.sort();
        assert_eq!(all, (0..lens.len()).collect::<Vec<_>>());
        assert!(packs.iter().all(|p| p.iter().map(|&i| lens[i]).sum::<usize>() <= 10));
    }

    #[test]
    fn an_oversized_sequence_gets_its_own_pack_and_nothing_is_lost() {
        assert_eq!(first_fit_decreasing(&[12, 4, 6], 10), vec![vec![0], vec![2, 1]]);
        assert!(first_fit_decreasing(&[], 10).is_empty());
    }

    #[test]
    fn balanced_packs_take_the_longest_into_the_lightest() {
        // Sorted: 7 (0), 5 (2), 4 (4), 3 (1), 3 (5), 2 (3), 1 (6). 7 -> A, 5 -> B, 4 -> B (9), 3 (1) -> A
        // (10), 3 (5) -> B (12), 2 -> A (12), 1 -> A (13): packs of 13 and 12 tokens.
        let lens = [7, 3, 5, 2, 4, 3, 1];
        let packs = balanced(&lens, 2, 16).unwrap();
        assert_eq!(packs, vec![vec![0, 1, 3, 6], vec![2, 4, 5]]);
        assert_eq!(balanced(&lens, 2, 12), None, "a 13-token pack passes the cap");
        // Fewer sequences than packs: no empty pack.
        assert_eq!(balanced(&[4, 9], 3, 10).unwrap(), vec![vec![1], vec![0]]);
    }

    #[test]
    fn computed_rows_count_padding_only_when_not_packed() {
        assert_eq!(computed_rows(&[7, 3, 5], true), 15);
        assert_eq!(computed_rows(&[7, 3, 5], false), 21);
        assert_eq!(computed_rows(&[], false), 0);
    }
}
