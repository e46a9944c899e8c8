//! The views kept beside a large recording (`run.pyprobe.views`): read when they
//! belong to it, else built from its events once and kept, so every later
//! `report`, `flame` and `top --from` of it opens at once.

use std::io::IsTerminal;
use std::path::Path;

use anyhow::{Context, Result};

use pyprobe_recording::analyze::SampleFilter;
use pyprobe_recording::output::calls::KeptReplay;
use pyprobe_recording::output::Planned;
use pyprobe_recording::stored::{self, FileState, Lookup, SaveError, StoredViews};

use super::reading::open;

/// Recordings from this size on get their views kept: below it, reading every
/// event takes about a second. `PYPROBE_STORE_VIEWS_BYTES` overrides it (tests).
const STORE_FROM_BYTES: u64 = 16 << 20;

fn store_from_bytes() -> u64 {
    std::env::var("PYPROBE_STORE_VIEWS_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(STORE_FROM_BYTES)
}

/// Whether what the views file is (built, stale, unreadable) is said on stderr:
/// not under a full-screen view.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Notes {
    Say,
    Quiet,
}

/// The views of `file` for a view counting the samples `samples` keeps, when
/// they can serve it: the default filter, a recording large enough to keep
/// them, and, with `idle_if_all_waiting`, some sample kept (a run whose every
/// sample waited is folded again with them all, from its events).
pub(crate) fn usable_views(
    file: &Path,
    samples: SampleFilter,
    idle_if_all_waiting: bool,
    notes: Notes,
) -> Result<Option<StoredViews>> {
    if samples != SampleFilter::default() {
        return Ok(None);
    }
    let Some(views) = views_of(file, notes)? else {
        return Ok(None);
    };
    let t = views.stacks.tally;
    if idle_if_all_waiting && t.kept == 0 && t.left_out() > 0 {
        return Ok(None);
    }
    Ok(Some(views))
}

/// The first pass (the replay's plan, the census of every call) kept beside
/// `file`, if its views are kept and belong to it; nothing is built, nor said.
pub(crate) fn kept_planned(file: &Path) -> Option<Planned> {
    kept_views(file).map(|views| views.planned)
}

/// The replay kept beside `file` (its plan, where it can be taken up, the
/// recording's names), if its views are kept and belong to it; nothing is
/// built, nor said.
pub(crate) fn kept_replay(file: &Path) -> Option<KeptReplay> {
    kept_views(file).map(|views| KeptReplay {
        plan: views.planned.plan,
        checkpoints: views.checkpoints,
        strings: views.strings,
        qualnames: views.info.qualnames,
    })
}

fn kept_views(file: &Path) -> Option<StoredViews> {
    let size = FileState::of(file).ok()?.bytes();
    if size < store_from_bytes() {
        return None;
    }
    match stored::load(file) {
        Lookup::Fresh(views) => Some(*views),
        _ => None,
    }
}

/// The views kept beside `file`, or built and kept now; for a small recording,
/// only those `record` built while writing it (else `None`).
fn views_of(file: &Path, notes: Notes) -> Result<Option<StoredViews>> {
    let say = |line: String| {
        if notes == Notes::Say {
            eprintln!("{line}");
        }
    };
    let before = FileState::of(file).with_context(|| format!("cannot read {}", file.display()))?;
    if before.bytes() < store_from_bytes() {
        // None is kept beside a small recording; those `record` built while
        // writing it serve its first view all the same.
        return Ok(stored::ahead::take(file).map(|(views, _)| views));
    }
    let kept = stored::path_for(file);
    let lookup = match stored::load(file) {
        Lookup::Fresh(views) => return Ok(Some(*views)),
        other => other,
    };
    if let Some((views, completion)) = stored::ahead::take(file) {
        // Built while the recording was written (`record`).
        match stored::save(file, before, completion, &views) {
            Ok((path, _)) => say(format!(
                "pyprobe: what every view of {} needs was built while it was written: kept in \
                 {}, and its next report, flame graph or top opens at once",
                file.display(),
                path.display()
            )),
            Err(e) => say(cannot_keep(file, &e)),
        }
        return Ok(Some(views));
    }
    match lookup {
        Lookup::Fresh(_) | Lookup::Missing => say(format!(
            "pyprobe: reading the {} MB of {} once for every view: what they need is kept in \
             {}, and its next report, flame graph or top opens at once",
            before.bytes() / 1_000_000,
            file.display(),
            kept.display()
        )),
        Lookup::Stale => say(format!(
            "pyprobe: {} describes another state of {} (or another pyprobe's reading): \
             reading its events again",
            kept.display(),
            file.display()
        )),
        Lookup::Unreadable(why) => say(format!(
            "pyprobe: note: {} is unreadable ({why}): reading the events of {} again",
            kept.display(),
            file.display()
        )),
    }
    let mut reader = open(file)?;
    let bar = (notes == Notes::Say && std::io::stderr().is_terminal()).then(|| {
        let len = before.bytes().saturating_mul(2);
        crate::session::progress::bar(len, format!("pyprobe: reading {}", file.display()))
    });
    let views = StoredViews::build_reporting(&mut reader, &mut |pass, read| {
        if let Some(bar) = &bar {
            bar.set_position(u64::from(pass) * before.bytes() + read);
        }
    })
    .with_context(|| format!("cannot read {}", file.display()));
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    let views = views?;
    if let Err(e) = stored::save(file, before, reader.completion(), &views) {
        say(cannot_keep(file, &e));
    }
    Ok(Some(views))
}

/// Why the views of `file` are not kept.
fn cannot_keep(file: &Path, e: &SaveError) -> String {
    match e {
        SaveError::Unfinished => format!(
            "pyprobe: note: {} has no end marker (cut short, or still being written): its \
             views are not kept",
            file.display()
        ),
        e => format!(
            "pyprobe: note: cannot keep the views beside {} ({e}): each view reads every event",
            file.display()
        ),
    }
}
