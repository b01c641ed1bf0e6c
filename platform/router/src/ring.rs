//! Consistent hashing with bounded loads (Mirrokni, Thorup, Zadimoghaddam): a key goes to
//! the first worker clockwise from its point on the ring whose load is under the bound.
//! Adding or removing a worker moves only the keys whose owner changed — about 1/N of them.

use xxhash_rust::xxh3::xxh3_64;

/// Points per worker: enough for an even spread over few workers.
const VNODES: usize = 160;

#[derive(Debug, Clone, Default)]
pub struct HashRing {
    points: Vec<(u64, usize)>,
}

impl HashRing {
    /// `workers`: (slot, stable name) — the name fixes the worker's points on the ring.
    pub fn new<'a>(workers: impl IntoIterator<Item = (usize, &'a str)>) -> Self {
        let mut points = Vec::new();
        for (slot, name) in workers {
            for v in 0..VNODES {
                points.push((xxh3_64(format!("{name}#{v}").as_bytes()), slot));
            }
        }
        points.sort_unstable();
        Self { points }
    }

    /// Distinct workers in ring order from `key`'s point.
    pub fn walk(&self, key: u64) -> impl Iterator<Item = usize> + '_ {
        let start = self.points.partition_point(|p| p.0 < key);
        let n = self.points.len();
        let mut seen = 0u64;
        (0..n).filter_map(move |i| {
            let slot = self.points[(start + i) % n].1;
            let bit = 1u64 << (slot % 64);
            if seen & bit != 0 {
                return None;
            }
            seen |= bit;
            Some(slot)
        })
    }

    /// The owner of `key` ignoring load.
    pub fn owner(&self, key: u64) -> Option<usize> {
        self.walk(key).next()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adding_a_worker_moves_about_one_nth_of_the_keys() {
        let names: Vec<String> = (0..8).map(|i| format!("http://worker-{i}:8081")).collect();
        let seven = HashRing::new(names[..7].iter().enumerate().map(|(i, n)| (i, n.as_str())));
        let eight = HashRing::new(names.iter().enumerate().map(|(i, n)| (i, n.as_str())));
        let keys = 20_000u64;
        let mut moved = 0;
        let mut share = [0u32; 8];
        for k in 0..keys {
            let key = xxh3_64(&k.to_le_bytes());
            let (a, b) = (seven.owner(key).unwrap(), eight.owner(key).unwrap());
            if a != b {
                moved += 1;
                assert_eq!(b, 7, "a key may only move to the new worker");
            }
            share[b] += 1;
        }
        let frac = moved as f64 / keys as f64;
        assert!(frac <= 1.0 / 8.0 + 0.03, "moved {frac}");
        for s in share {
            let f = s as f64 / keys as f64;
            assert!((0.08..0.17).contains(&f), "uneven share {f}");
        }
    }
}
