//! Power-of-two latency histogram.

/// Counts durations in power-of-two buckets: bucket `i` holds durations in
/// `[2^i, 2^(i+1))` ns, except bucket 0, which also holds 0.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(into = "Vec<u64>", try_from = "Vec<u64>")]
pub struct Histogram {
    buckets: [u64; 64],
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram { buckets: [0; 64] }
    }
}

impl From<Histogram> for Vec<u64> {
    fn from(h: Histogram) -> Self {
        h.buckets.to_vec()
    }
}

impl TryFrom<Vec<u64>> for Histogram {
    type Error = String;

    fn try_from(buckets: Vec<u64>) -> Result<Self, Self::Error> {
        let n = buckets.len();
        let buckets = buckets
            .try_into()
            .map_err(|_| format!("a histogram has 64 buckets, not {n}"))?;
        Ok(Histogram { buckets })
    }
}

impl Histogram {
    /// Adds one duration.
    pub fn record(&mut self, ns: u64) {
        let i = 63 - ns.max(1).leading_zeros() as usize;
        self.buckets[i] = self.buckets[i].saturating_add(1);
    }

    /// Adds every count of `other`.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.buckets.iter_mut().zip(other.buckets.iter()) {
            *a = a.saturating_add(*b);
        }
    }

    /// Non-empty buckets as `(low_ns, high_ns_exclusive, count)`; the top bucket's
    /// high end saturates at `u64::MAX`.
    pub(crate) fn buckets(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.buckets
            .iter()
            .enumerate()
            .filter(|(_, &n)| n > 0)
            .map(|(i, &n)| {
                let low = if i == 0 { 0 } else { 1u64 << i };
                let high = 1u64.checked_shl(i as u32 + 1).unwrap_or(u64::MAX);
                (low, high, n)
            })
    }

    /// Total count.
    pub fn count(&self) -> u64 {
        self.buckets.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_powers_of_two() {
        let mut h = Histogram::default();
        for ns in [0, 1, 2, 3, 4, 1000, 1023, 1024, u64::MAX] {
            h.record(ns);
        }
        let b: Vec<_> = h.buckets().collect();
        assert_eq!(
            b,
            vec![
                (0, 2, 2),
                (2, 4, 2),
                (4, 8, 1),
                (512, 1024, 2),
                (1024, 2048, 1),
                (1 << 63, u64::MAX, 1)
            ]
        );
        assert_eq!(h.count(), 9);
    }
}
