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
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let (mut packs, mut room): (Vec<Vec<usize>>, Vec<usize>) = (vec![], vec![]);
    for i in order {
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
    fn computed_rows_count_padding_only_when_not_packed() {
        assert_eq!(computed_rows(&[7, 3, 5], true), 15);
        assert_eq!(computed_rows(&[7, 3, 5], false), 21);
        assert_eq!(computed_rows(&[], false), 0);
    }
}
