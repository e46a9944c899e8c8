//! The flame graph as SVG, through `inferno`: its title and subtitle, and
//! frames coloured by where their code comes from.

use std::io::{self, Write};

use inferno::flamegraph::color::{Color, PaletteMap};
use inferno::flamegraph::{self, Options};

use super::folded_stacks::ViewInfo;
use crate::analyze::folded::{Folded, Measure};
use crate::analyze::SampleFilter;
use crate::output::names::{FrameNames, Origin};
use crate::output::units::format_ns;
use crate::recording::Header;

/// The default title: the target's command line.
pub fn default_title(header: &Header) -> String {
    let what = if !header.command_line.is_empty() {
        header.command_line.join(" ")
    } else if !header.executable.is_empty() {
        header.executable.clone()
    } else {
        format!("pid {}", header.pid)
    };
    let what: String = if what.chars().count() > 100 {
        what.chars().take(99).collect::<String>() + "…"
    } else {
        what
    };
    format!("pyprobe: {what}")
}

/// `1234567` as `1,234,567`.
pub fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// The subtitle: pid, python version, mode, duration, events or samples, and
/// what the width means.
pub fn subtitle(folded: &Folded, info: &ViewInfo, measure: Measure) -> String {
    let h = &info.header;
    let c = folded.counts;
    let python = if h.python_version.is_empty() {
        "?"
    } else {
        &h.python_version
    };
    let sampled = measure == Measure::Samples;
    let mode = match h.mode.as_str() {
        "auto" if sampled => "auto (sampled)",
        "auto" => "auto (traced)",
        m => m,
    };
    let duration = format_ns(info.duration_ns(c.first_ts, c.last_ts));
    let count = if sampled {
        let every = if h.sample_interval_ns > 0 {
            format!(" every {}", format_ns(h.sample_interval_ns))
        } else {
            String::new()
        };
        let t = folded.tally;
        let which = match (t.applied, t.filter.idle, t.filter.gil) {
            (false, ..) => "",
            // Recorded before samples kept their thread's state: nothing was told apart.
            _ if t.kept > 0 && t.cpu_unknown == t.kept => ", thread state not recorded",
            (true, false, false) => ", threads on a CPU",
            (true, true, false) => ", idle threads included",
            (true, _, true) => ", the GIL holder's",
        };
        let left = match t.left_out() {
            0 => String::new(),
            n if t.filter == SampleFilter::default() => {
                format!(" ({} idle left out)", thousands(n))
            }
            n => format!(" ({} left out)", thousands(n)),
        };
        format!("{} samples{every}{which}{left}", thousands(t.kept))
    } else {
        format!("{} events", thousands(c.events))
    };
    let lost = c.lost.max(info.trailer_lost);
    let lost = if lost > 0 {
        format!(", {} lost", thousands(lost))
    } else {
        String::new()
    };
    let cut = if info.truncated_at.is_some() {
        ", cut short"
    } else {
        ""
    };
    let width = match measure {
        Measure::Time => "width: own time",
        Measure::Calls => "width: calls",
        Measure::Samples => "width: samples",
    };
    format!(
        "pid {}, CPython {python}, {mode} mode, {duration}, {count}{lost}{cut}; {width}",
        h.pid
    )
}

/// A colour per frame name: application code warm, the standard library
/// yellow, third-party packages aqua, GC blue; the shade comes from a hash of
/// the name, so a function keeps its colour from one graph to the next.
fn frame_color(name: &str, origin: Option<Origin>) -> Color {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.as_bytes() {
        hash ^= u64::from(*b);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    let v = |shift: u32| ((hash >> shift) & 0xffff) as f32 / 65535.0;
    let (v1, v2, v3) = (v(0), v(16), v(32));
    let c = |base: u8, range: f32, x: f32| base.saturating_add((range * x) as u8);
    match origin {
        Some(Origin::App) => Color {
            r: c(205, 50.0, v3),
            g: c(0, 230.0, v1),
            b: c(0, 55.0, v2),
        },
        Some(Origin::Stdlib) => Color {
            r: c(175, 55.0, v1),
            g: c(175, 55.0, v1),
            b: c(50, 20.0, v1),
        },
        Some(Origin::ThirdParty) => Color {
            r: c(50, 60.0, v1),
            g: c(165, 55.0, v1),
            b: c(165, 55.0, v1),
        },
        None => Color {
            r: c(80, 60.0, v1),
            g: c(80, 60.0, v1),
            b: c(205, 50.0, v1),
        },
        Some(Origin::Process) => Color {
            r: c(160, 40.0, v1),
            g: c(160, 40.0, v1),
            b: c(160, 40.0, v1),
        },
    }
}

/// Everything [`write_svg`] draws besides the stacks.
pub struct SvgOptions<'a> {
    /// The title; default [`default_title`].
    pub title: Option<&'a str>,
}

/// Draws the flame graph as SVG. Fails when there is nothing to draw.
pub fn write_svg<W: Write>(
    folded: &Folded,
    info: &ViewInfo,
    measure: Measure,
    names: &FrameNames<'_>,
    options: &SvgOptions<'_>,
    out: W,
) -> io::Result<()> {
    let mut opt = Options::default();
    // Stacks narrower than inferno draws need not reach it: fold them into
    // their parents (half its threshold, to stay clear of its rounding), which
    // keeps memory to the frames drawn, not every stack recorded.
    let total = folded.total(measure);
    let min_total = (opt.min_width * total as f64 / 100.0 / 2.0).floor() as u64;
    let mut palette = PaletteMap::default();
    let mut lines = Vec::new();
    folded.walk_named(
        measure,
        min_total.max(1),
        |f| {
            let name = names.fold_frame(f);
            if palette.get(&name).is_none() {
                palette.insert(&name, frame_color(&name, names.origin(f)));
            }
            name
        },
        |path, value| lines.push(format!("{} {value}", path.join(";"))),
    );
    if lines.is_empty() {
        let t = folded.tally;
        let why = if t.kept == 0 && t.left_out() > 0 {
            format!(
                "nothing to draw: every one of the {} samples was left out ({}; --idle \
                 includes waiting threads{})",
                t.samples,
                t.filter.describe(),
                if t.filter.gil {
                    ", without --gil every thread"
                } else {
                    ""
                }
            )
        } else {
            "nothing to draw: the recording has no stacks (no call/return or sample events)"
                .to_string()
        };
        return Err(io::Error::new(io::ErrorKind::InvalidData, why));
    }
    lines.sort_unstable();
    let title = options
        .title
        .map(str::to_owned)
        .unwrap_or_else(|| default_title(&info.header));
    opt.title = title;
    opt.subtitle = Some(subtitle(folded, info, measure));
    opt.deterministic = true;
    opt.palette_map = Some(&mut palette);
    opt.no_sort = true;
    opt.name_type = "Function:".into();
    opt.notes = format!("pyprobe {}", env!("CARGO_PKG_VERSION"));
    match measure {
        Measure::Time => {
            // Values are ns; show µs.
            opt.count_name = "µs".into();
            opt.factor = 0.001;
        }
        Measure::Calls => opt.count_name = "calls".into(),
        Measure::Samples => opt.count_name = "samples".into(),
    }
    flamegraph::from_lines(&mut opt, lines.iter().map(String::as_str), out)
}
