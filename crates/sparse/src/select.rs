//! Top-K page selection (Quest §3.3) and the overlap of two selections (FlexiCache's
//! stability measure): deterministic, so that a run's pages — and so its bytes moved — are
//! reproducible. Ties go to the earlier page; a NaN score ranks last.
use std::cmp::Ordering;

/// The `k` best pages of `scores` (page `first + i` scores `scores[i]`), ascending by page.
pub fn top_k(scores: &[f32], first: usize, k: usize) -> Vec<usize> {
    if k >= scores.len() {
        return (first..first + scores.len()).collect();
    }
    let key = |s: f32| if s.is_nan() { f32::NEG_INFINITY } else { s };
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    let order = |&a: &usize, &b: &usize| -> Ordering {
        key(scores[b]).total_cmp(&key(scores[a])).then(a.cmp(&b))
    };
    if k > 0 {
        idx.select_nth_unstable_by(k - 1, order);
    }
    let mut out: Vec<usize> = idx[..k].iter().map(|i| first + i).collect();
    out.sort_unstable();
    out
}

/// Share of `a`'s pages also in `b` (both ascending); 1 when `a` is empty.
pub fn overlap(a: &[usize], b: &[usize]) -> f64 {
    if a.is_empty() {
        return 1.0;
    }
    let (mut i, mut j, mut both) = (0, 0, 0usize);
    while i < a.len() && j < b.len() {
        match a[i].cmp(&b[j]) {
            Ordering::Less => i += 1,
            Ordering::Greater => j += 1,
            Ordering::Equal => {
                both += 1;
                i += 1;
                j += 1;
            }
        }
    }
    both as f64 / a.len() as f64
}

/// The pages of `a` or `b` (both ascending), ascending.
pub fn union(a: &[usize], b: &[usize]) -> Vec<usize> {
    let mut out: Vec<usize> = a.iter().chain(b).copied().collect();
    out.sort_unstable();
    out.dedup();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The selection by a full sort: score descending, then page ascending.
    fn brute(scores: &[f32], first: usize, k: usize) -> Vec<usize> {
        let mut all: Vec<(f32, usize)> = scores
            .iter()
            .enumerate()
            .map(|(i, &s)| (if s.is_nan() { f32::NEG_INFINITY } else { s }, first + i))
            .collect();
        all.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut out: Vec<usize> = all.iter().take(k).map(|p| p.1).collect();
        out.sort_unstable();
        out
    }

    proptest! {
        /// The selection equals a brute-force ranking, ties and NaNs included.
        #[test]
        fn top_k_equals_a_brute_force_ranking(
            scores in proptest::collection::vec(prop_oneof![
                (-4i32..4).prop_map(|x| x as f32),
                Just(f32::NAN),
                -1e3f32..1e3,
            ], 0..60),
            k in 0usize..70,
            first in 0usize..5,
        ) {
            prop_assert_eq!(top_k(&scores, first, k), brute(&scores, first, k));
        }

        #[test]
        fn overlap_counts_shared_pages(a in proptest::collection::btree_set(0usize..30, 0..20),
                                       b in proptest::collection::btree_set(0usize..30, 0..20)) {
            let (av, bv): (Vec<usize>, Vec<usize>) = (a.iter().copied().collect(), b.iter().copied().collect());
            let want = if a.is_empty() { 1.0 } else { a.intersection(&b).count() as f64 / a.len() as f64 };
            prop_assert_eq!(overlap(&av, &bv), want);
            let u: Vec<usize> = a.union(&b).copied().collect();
            prop_assert_eq!(union(&av, &bv), u);
        }
    }
}
