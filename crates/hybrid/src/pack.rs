//! Mini-batch packing (HybridServe §4.3): the requests of a step are split into
//! mini-batches whose staged bytes fit one staging unit, greedily keeping each
//! mini-batch's transfer and recompute time close (bin packing on the KV/ACT imbalance):
//! a mini-batch that transfers while it recomputes leaves neither the link nor the device
//! idle.
//!
//! First-fit decreasing on the bytes says how many mini-batches are needed; then requests,
//! largest first, each go to the mini-batch with room whose summed imbalance they bring
//! closest to zero (a new one only when none has room). A request larger than a unit on
//! its own gets a mini-batch to itself.

/// What one request brings to a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Load {
    /// Bytes it stages (host K/V and host activations, one layer).
    pub bytes: u64,
    /// Transfer seconds minus recompute seconds (one layer).
    pub imbalance_s: f64,
}

/// Mini-batches of indices into `loads`, each within `cap` staged bytes (`None` = one
/// mini-batch holding everything).
pub fn pack(loads: &[Load], cap: Option<u64>) -> Vec<Vec<usize>> {
    let Some(cap) = cap else {
        return if loads.is_empty() {
            Vec::new()
        } else {
            vec![(0..loads.len()).collect()]
        };
    };
    let mut order: Vec<usize> = (0..loads.len()).collect();
    order.sort_by(|&a, &b| {
        loads[b]
            .bytes
            .cmp(&loads[a].bytes)
            .then(
                loads[b]
                    .imbalance_s
                    .abs()
                    .total_cmp(&loads[a].imbalance_s.abs()),
            )
            .then(a.cmp(&b))
    });
    // How many mini-batches are needed at all: first-fit decreasing on the bytes.
    let mut fill: Vec<u64> = Vec::new();
    for &i in &order {
        match fill.iter_mut().find(|f| **f + loads[i].bytes <= cap) {
            Some(f) => *f += loads[i].bytes,
            None => fill.push(loads[i].bytes),
        }
    }
    // Then that many, each request going where the summed imbalance ends closest to zero
    // (ties: the emptier one); a new one only when none has room.
    // (members, bytes, imbalance)
    let mut bins: Vec<(Vec<usize>, u64, f64)> = vec![(Vec::new(), 0, 0.0); fill.len()];
    for i in order {
        let l = loads[i];
        let best = bins
            .iter()
            .enumerate()
            .filter(|(_, b)| b.0.is_empty() || b.1 + l.bytes <= cap)
            .min_by(|(_, a), (_, b)| {
                (a.2 + l.imbalance_s)
                    .abs()
                    .total_cmp(&(b.2 + l.imbalance_s).abs())
                    .then(a.1.cmp(&b.1))
            })
            .map(|(j, _)| j);
        match best.and_then(|j| bins.get_mut(j)) {
            Some(b) => {
                b.0.push(i);
                b.1 += l.bytes;
                b.2 += l.imbalance_s;
            }
            None => bins.push((vec![i], l.bytes, l.imbalance_s)),
        }
    }
    bins.into_iter()
        .filter(|b| !b.0.is_empty())
        .map(|(mut m, _, _)| {
            m.sort_unstable();
            m
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_request_once_within_capacity() {
        let loads: Vec<Load> = (0..23)
            .map(|i| Load {
                bytes: (i * 37 % 11 + 1) as u64 * 100,
                imbalance_s: ((i * 13 % 7) as f64 - 3.0) * 1e-3,
            })
            .collect();
        for cap in [1100, 1500, 4000, 100_000] {
            let bins = pack(&loads, Some(cap));
            let mut seen: Vec<usize> = bins.iter().flatten().copied().collect();
            seen.sort_unstable();
            assert_eq!(seen, (0..loads.len()).collect::<Vec<_>>());
            for b in &bins {
                let bytes: u64 = b.iter().map(|&i| loads[i].bytes).sum();
                assert!(bytes <= cap || b.len() == 1, "cap {cap}: {bytes}");
            }
        }
        assert_eq!(pack(&loads, None).len(), 1);
        assert!(pack(&[], Some(10)).is_empty());
    }

    #[test]
    fn pairs_opposite_imbalances() {
        // Two transfer-heavy and two recompute-heavy requests, room for two per batch:
        // each batch should pair one of each.
        let l = |imb: f64| Load {
            bytes: 10,
            imbalance_s: imb,
        };
        let bins = pack(&[l(1.0), l(1.0), l(-1.0), l(-1.0)], Some(20));
        assert_eq!(bins.len(), 2);
        for b in bins {
            let sum: f64 = b.iter().map(|&i| [1.0, 1.0, -1.0, -1.0][i]).sum();
            assert_eq!(sum, 0.0);
        }
    }
}
