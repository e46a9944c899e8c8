//! Quantities as every view writes them.

/// A duration in human units with three significant digits: `850 ns`,
/// `12.3 µs`, `4.56 ms`, `1.20 s`.
pub fn format_ns(ns: u64) -> String {
    const UNITS: [(u64, &str); 3] = [(1_000_000_000, "s"), (1_000_000, "ms"), (1_000, "µs")];
    for (scale, unit) in UNITS {
        if ns >= scale {
            let v = ns as f64 / scale as f64;
            return if v >= 100.0 {
                format!("{v:.0} {unit}")
            } else if v >= 10.0 {
                format!("{v:.1} {unit}")
            } else {
                format!("{v:.2} {unit}")
            };
        }
    }
    format!("{ns} ns")
}
