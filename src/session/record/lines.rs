//! What `record` says on stderr: the start line, the probe sites armed and left
//! alone, and the overhead budget's closing line.

use std::cell::RefCell;
use std::path::PathBuf;

use pyprobe_cpython::python::probe_catalog::ProbeGroup;
use pyprobe_sdt::process::status::cmdline;
use pyprobe_sdt::tracer::RingUse;

use super::events::EventBuilder;
use super::request::{RecordRequest, Target};
use super::resolver::{returns_only, Chosen, Mode};

/// The line that says, once the interpreter is known, what is traced and how:
/// the process, its CPython, the mode, the sampling rate, the probes and their
/// engine, and where the recording goes.
pub(super) struct StartLine<'a> {
    pub mode: Mode,
    pub request: &'a RecordRequest,
    pub budget: Option<f64>,
    /// The view written at the end, when -o names one.
    pub view: Option<PathBuf>,
}

/// At most this many characters of the target's command line in the start line.
const COMMAND_CHARS: usize = 48;

impl StartLine<'_> {
    pub fn print(&self, chosen: &Chosen, pid: i32, builder: &EventBuilder) {
        eprintln!("{}", self.text(chosen, pid, builder));
        if self.request.verbose {
            eprintln!("pyprobe: interpreter: {}", chosen.object_path);
            if let Some(w) = &chosen.warning {
                eprintln!("pyprobe: note: {w}");
            }
        }
    }

    fn text(&self, chosen: &Chosen, pid: i32, builder: &EventBuilder) -> String {
        let request = self.request;
        let version = chosen
            .version
            .map(|v| v.to_string())
            .unwrap_or_else(|| "?".into());
        let argv = match &request.target {
            Some(Target::Launch(command)) => command.clone(),
            _ => cmdline(pid),
        };
        // The program by its name, not its directory.
        let command = argv
            .iter()
            .enumerate()
            .map(|(i, a)| match i {
                0 => a.rsplit('/').next().unwrap_or(a),
                _ => a.as_str(),
            })
            .collect::<Vec<_>>()
            .join(" ");
        let command = if command.chars().count() > COMMAND_CHARS {
            let cut: String = command.chars().take(COMMAND_CHARS - 1).collect();
            format!("{cut}…")
        } else {
            command
        };
        let groups: Vec<&str> = chosen.groups.iter().map(|g| g.name()).collect();
        let rate = request.rate;
        let sampled = format!(
            "stacks sampled at {rate} Hz{}",
            if request.nonblocking {
                " without stopping the threads"
            } else {
                ", stopping the threads briefly"
            }
        );
        // 3.12+ registers with sys.monitoring; before, the hook is each thread's
        // profile function.
        let hook_route = match chosen.version {
            Some(v) if !v.at_least(3, 12) => "profile function",
            _ => "sys.monitoring",
        };
        let engine = match request.ring {
            _ if chosen.hook && groups.len() > 1 => {
                format!("engine hook for calls ({hook_route}); the rest: ring, else int3")
            }
            _ if chosen.hook => format!("engine hook ({hook_route})"),
            RingUse::Auto => "engine auto: ring, else int3".into(),
            RingUse::Required => "engine ring".into(),
            RingUse::Off => "engine int3".into(),
        };
        let what = match self.mode {
            Mode::Trace if returns_only(chosen.version, &chosen.groups, chosen.hook) => {
                let others: Vec<&str> = groups
                    .iter()
                    .copied()
                    .filter(|g| *g != "function")
                    .collect();
                let others = if others.is_empty() {
                    String::new()
                } else {
                    format!(", {}", others.join(", "))
                };
                format!(
                    "mode trace: function returns (this CPython's entries do not fire){others} \
                     exact ({engine}); times from stacks sampled at {rate} Hz without stopping \
                     the threads"
                )
            }
            Mode::Trace => format!("mode trace: {} exact ({engine})", groups.join(", ")),
            Mode::Sample => format!("mode sample: {sampled}"),
            Mode::Auto if chosen.has_probes && !groups.is_empty() => {
                format!(
                    "mode auto: {sampled}; {} exact ({engine})",
                    groups.join(", ")
                )
            }
            Mode::Auto if chosen.has_probes => format!("mode auto: {sampled}"),
            Mode::Auto => format!(
                "mode auto: {sampled}; no exact events: this CPython has no SDT probes (built \
                 without --with-dtrace)"
            ),
        };
        let budget = match self.budget {
            Some(max)
                if chosen.groups.contains(&ProbeGroup::Function)
                    || chosen.groups.contains(&ProbeGroup::Line) =>
            {
                format!(
                    "; overhead budget {}%: above it, function probes go off and stacks are \
                     sampled",
                    max * 100.0
                )
            }
            Some(max) if chosen.has_probes => format!(
                "; overhead budget {}%: above it, GC, import and audit events go without their \
                 stacks",
                max * 100.0
            ),
            _ => String::new(),
        };
        let into = match (builder.writing_to(), self.view.as_deref()) {
            (None, _) => String::new(),
            (Some((writing, final_name)), view) => {
                let recording = if writing == final_name {
                    format!("{}", final_name.display())
                } else {
                    format!("{} ({} when done)", writing.display(), final_name.display())
                };
                match view {
                    Some(v) => format!("; writing {recording}, then {}", v.display()),
                    None => format!("; writing {recording}"),
                }
            }
        };
        format!(
            "pyprobe: process {pid}{} ({}), CPython {version}: {what}{budget}{into}",
            pyprobe_sdt::process::status::ns_pid_note(pid),
            pyprobe_recording::output::terminal::escaped(&command),
        )
    }
}

pub(super) fn armed_line(pid: i32, sites: usize) -> String {
    format!("pyprobe: {sites} probe sites armed in process {pid}")
}

/// What the resolver left alone in `pid` (forged or corrupt notes, odd
/// semaphores): one line each with `verbose`, else one line saying how many.
/// Sites holding something else than their `nop` are reported by the engine.
pub(super) fn refusal_lines(pid: i32, chosen: &RefCell<Chosen>, verbose: bool) -> Vec<String> {
    let refusals = chosen
        .borrow_mut()
        .refusals
        .remove(&pid)
        .unwrap_or_default();
    if refusals.is_empty() {
        return Vec::new();
    }
    if !verbose {
        return vec![format!(
            "pyprobe: process {pid}: {} probe note{} or semaphore{} failed pyprobe's checks and \
             {} left alone, not traced (-v says which and why)",
            refusals.len(),
            if refusals.len() == 1 { "" } else { "s" },
            if refusals.len() == 1 { "" } else { "s" },
            if refusals.len() == 1 { "is" } else { "are" }
        )];
    }
    refusals
        .into_iter()
        .map(|why| format!("pyprobe: process {pid}: {why}"))
        .collect()
}

/// Said when pyprobe fell behind the sampling rate asked for (5 % of the ticks or
/// more): views count time as samples × interval, so the time they show falls
/// short by as much. Ticks lost while pyprobe was stopped or starved for long are
/// told apart from a rate too high for the machine: only the latter has a remedy
/// in `-r`.
pub(super) fn missed_ticks_line(
    ticks: pyprobe_sdt::tracer::TickCount,
    interval_ns: u64,
) -> Option<String> {
    let due = ticks.taken + ticks.missed;
    if !worth_a_caveat(ticks.missed, due) {
        return None;
    }
    let hz = 1e9 / interval_ns.max(1) as f64;
    let stall_ms = pyprobe_sdt::tracer::STALL_NS / 1_000_000;
    let why = if ticks.stalled * 2 >= ticks.missed {
        format!(
            "{} of them while pyprobe itself was stopped (Ctrl-Z, SIGSTOP) or starved of \
             CPU for {stall_ms} ms or more at a time; sampled times fall short by as much",
            ticks.stalled
        )
    } else {
        "pyprobe not being given a CPU in time; sampled times fall short by as much \
         (a less busy machine, or a lower -r, keeps up)"
            .to_string()
    };
    Some(format!(
        "fell behind: {} of the {due} samples due at {hz:.0} Hz were not taken ({:.0}%), {why}",
        ticks.missed,
        ticks.missed as f64 * 100.0 / due as f64
    ))
}

/// Whether `part` of `whole` (ticks missed, stacks with gone frames) is worth a
/// caveat: 10 or more, and at least 5 %.
fn worth_a_caveat(part: u64, whole: u64) -> bool {
    part >= 10 && part * 20 >= whole
}

/// The caveat of stacks captured in the target (GC, import and audit events through
/// the ring) with frames pyprobe could not name: their code objects were freed
/// before it read the records. Said, as missed ticks are, when it is 10 stacks or
/// more and at least 5 % of those captured: code that runs once (a line a `.pth`
/// file runs at start, a module body) is often freed before the next read, and a
/// few such frames, each drawn as gone where it stood, need no warning.
pub(super) fn gone_frames_line(captured: u64, stacks: u64, frames: u64) -> Option<String> {
    if !worth_a_caveat(stacks, captured) {
        return None;
    }
    Some(format!(
        "{stacks} of the {captured} stacks captured with events held {frames} frame{} whose \
         code objects were freed before pyprobe read them (code that ran once, or pyprobe \
         not given a CPU in time): each is drawn as `{}`",
        if frames == 1 { "" } else { "s" },
        pyprobe_cpython::python::walker::GONE_CODE
    ))
}

/// The closing line of an overhead budget: what it cost the target, and what it
/// left out to hold.
pub(super) fn budget_line(max: f64, b: &pyprobe_sdt::tracer::BudgetSummary) -> String {
    let sampled = if b.blocking_samples == 0 {
        String::new()
    } else {
        let steady = b
            .sample_steady_ns
            .map(|ns| format!(", {} µs in steady state", ns / 1000))
            .unwrap_or_default();
        let then = if b.samples_unblocked {
            ", then sampling went on without stopping it"
        } else if b.samples_too_costly {
            ", more than the budget leaves at this rate: lower -r to stay within it"
        } else {
            ""
        };
        format!(
            "; {} samples stopped it, {} µs each on average{steady}{then}",
            b.blocking_samples,
            b.sample_mean_ns / 1000,
        )
    };
    let held = if b.slowdown <= max {
        "held"
    } else {
        "exceeded"
    };
    let kept = if b.samples_only {
        String::new()
    } else if b.traced_functions {
        format!(
            "; calls traced exactly {:.1}% of the time, in {} window{}, sampled in between",
            b.exact_fraction * 100.0,
            b.windows,
            if b.windows == 1 { "" } else { "s" }
        )
    } else {
        format!(
            "; stacks of GC, import and audit events recorded {:.1}% of the time",
            b.exact_fraction * 100.0
        )
    };
    let setup = if b.setup_ns > 0 {
        format!(
            " (and {:.1} ms once, to set up the ring)",
            b.setup_ns as f64 / 1e6
        )
    } else {
        String::new()
    };
    format!(
        "overhead budget {}% {held}: the target was stopped for pyprobe {:.2}% of its run \
         time{setup}{kept}{sampled}",
        max * 100.0,
        b.slowdown * 100.0
    )
}

#[cfg(test)]
mod tests {
    use super::missed_ticks_line;
    use pyprobe_sdt::tracer::TickCount;

    #[test]
    fn a_shortfall_is_said_from_five_percent_of_the_ticks_due() {
        let at = |taken, missed| {
            let ticks = TickCount {
                taken,
                missed,
                stalled: 0,
            };
            missed_ticks_line(ticks, 2_500_000)
        };
        assert_eq!(at(1000, 0), None);
        assert_eq!(at(1000, 52), None, "under 5 %");
        assert_eq!(at(100, 9), None, "too few to matter");
        let line = at(318, 314).expect("half missed");
        assert!(
            line.starts_with(
                "fell behind: 314 of the 632 samples due at 400 Hz were not taken (50%)"
            ),
            "{line}"
        );
        assert!(line.contains("a lower -r"), "{line}");
    }

    #[test]
    fn ticks_lost_while_pyprobe_was_stopped_are_not_blamed_on_the_rate() {
        let ticks = TickCount {
            taken: 892,
            missed: 503,
            stalled: 500,
        };
        let line = missed_ticks_line(ticks, 10_000_000).expect("a third missed");
        assert!(
            line.starts_with(
                "fell behind: 503 of the 1395 samples due at 100 Hz were not taken (36%), 500 \
                 of them while pyprobe itself was stopped"
            ),
            "{line}"
        );
        assert!(!line.contains("-r"), "{line}");
    }
}
