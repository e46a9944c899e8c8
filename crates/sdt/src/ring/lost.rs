//! The producers' `lost` counter as pyprobe reports it: the target can write the
//! ring, so a reading that cannot be true is said to be corrupt, never printed as
//! a count.

/// What one reading of a ring's `lost` counter says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LostReading {
    /// No new loss.
    Nothing,
    /// This many events were dropped since the last reading.
    New(u64),
    /// The counter reads what cannot be true (it went back, or counts more than
    /// one event per nanosecond since pyprobe began to read the ring): the target
    /// wrote over it. Said once; its losses are not counted after that.
    Corrupt(u64),
}

/// A ring's `lost` counter, read now and then.
#[derive(Debug, Clone, Copy)]
pub struct LostCounter {
    /// The counter's value when pyprobe began to read the ring (a ring used again
    /// keeps an earlier pyprobe's count), and the time then.
    base: u64,
    since_ns: u64,
    reported: u64,
    corrupt: bool,
}

impl LostCounter {
    /// Counting from `value`, the counter as it reads at `now_ns`.
    pub fn new(value: u64, now_ns: u64) -> LostCounter {
        LostCounter {
            base: value,
            since_ns: now_ns,
            reported: value,
            corrupt: false,
        }
    }

    /// The counter reads `value` at `now_ns`.
    pub fn read(&mut self, value: u64, now_ns: u64) -> LostReading {
        if self.corrupt || value == self.reported {
            return LostReading::Nothing;
        }
        // An event costs a producer tens of nanoseconds at the very least.
        let possible = now_ns.saturating_sub(self.since_ns);
        if value < self.reported || value - self.base > possible {
            self.corrupt = true;
            return LostReading::Corrupt(value);
        }
        let new = value - self.reported;
        self.reported = value;
        LostReading::New(new)
    }

    /// Whether a reading was found corrupt.
    pub fn corrupt(&self) -> bool {
        self.corrupt
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn losses_are_counted_from_the_first_reading_and_only_when_they_can_be_true() {
        let mut c = LostCounter::new(40, 1_000);
        assert_eq!(c.read(40, 2_000), LostReading::Nothing);
        assert_eq!(c.read(45, 3_000), LostReading::New(5));
        assert_eq!(c.read(50, 4_000), LostReading::New(5));
        // More than one event per nanosecond since the start: forged.
        let mut f = LostCounter::new(0, 1_000);
        assert_eq!(
            f.read(u64::MAX - 663, 1_000_000),
            LostReading::Corrupt(u64::MAX - 663)
        );
        assert!(f.corrupt());
        // Said once; nothing counted after.
        assert_eq!(f.read(u64::MAX, 2_000_000), LostReading::Nothing);
        // Going back is forged too.
        let mut b = LostCounter::new(10, 0);
        assert_eq!(b.read(20, 1_000), LostReading::New(10));
        assert_eq!(b.read(15, 2_000), LostReading::Corrupt(15));
    }
}
