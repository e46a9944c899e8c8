//! `pyprobe flame` and `pyprobe calls`: read a recording and hand it to a view.

mod calls;
mod flame;
mod html;
mod reading;
mod stored;

pub use calls::{calls, CallsRequest};
pub use flame::{
    extension, flame, is_fifo, recording_beside, write_view_for_extension, FlameFormat,
    FlameRequest,
};
pub(crate) use reading::{note_cut_short, open};
pub(crate) use stored::{usable_views, Notes};
