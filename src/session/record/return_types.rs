//! The hook engine's return-type counts into the recording: one `return_type`
//! event per changed (function, type) row, its running total.

use pyprobe_recording::recording::{EventKind, FrameRef};
use pyprobe_sdt::tracer::ReturnRow;

use super::events::EventBuilder;

/// Writes `rows` of process `pid` (events on its main thread's id).
pub fn write_return_types(builder: &mut EventBuilder, pid: i32, ts_ns: u64, rows: &[ReturnRow]) {
    for row in rows {
        let function = FrameRef {
            file: builder.intern(&row.file),
            function: builder.intern(&row.function),
            line: row.first_line,
        };
        let returned = row.returned.as_deref().map(|t| builder.intern(t));
        builder.write(
            pid,
            ts_ns,
            EventKind::ReturnType {
                function,
                returned,
                total: row.total,
            },
        );
    }
}
