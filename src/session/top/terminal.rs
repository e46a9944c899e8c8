//! The terminal of the live `top`: raw mode and the alternate screen, a refresh
//! loop that draws each snapshot and reads keys, and the terminal restored on
//! every way out: quit keys, an error, SIGTERM, SIGHUP or SIGINT, and a panic.

use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crossterm::event::{self, Event as TermEvent, KeyEventKind};
use crossterm::terminal::{
    disable_raw_mode, enable_raw_mode, EnterAlternateScreen, LeaveAlternateScreen,
};
use ratatui::backend::CrosstermBackend;
use ratatui::Terminal;

use pyprobe_recording::output::top::{draw, handle_key, Snapshot, ViewState};

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Puts the terminal back (raw mode off, main screen, cursor shown).
fn restore_terminal() {
    let _ = disable_raw_mode();
    let _ = crossterm::execute!(io::stdout(), LeaveAlternateScreen, crossterm::cursor::Show);
}

/// Restores the terminal, the panic hook and the signal handlers when dropped.
struct TerminalGuard {
    old_signals: Vec<(nix::sys::signal::Signal, nix::sys::signal::SigAction)>,
    previous_hook: Option<Arc<PanicHook>>,
}

type PanicHook = Box<dyn Fn(&std::panic::PanicHookInfo<'_>) + Sync + Send + 'static>;

impl TerminalGuard {
    fn install() -> io::Result<Self> {
        use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
        STOP.store(false, Ordering::SeqCst);
        let mut old_signals = Vec::new();
        let action = SigAction::new(
            SigHandler::Handler(on_signal),
            SaFlags::empty(),
            SigSet::empty(),
        );
        for sig in [Signal::SIGTERM, Signal::SIGHUP, Signal::SIGINT] {
            // SAFETY: the handler only stores to an atomic.
            if let Ok(old) = unsafe { sigaction(sig, &action) } {
                old_signals.push((sig, old));
            }
        }
        let previous: Arc<PanicHook> = Arc::new(std::panic::take_hook());
        let chained = previous.clone();
        std::panic::set_hook(Box::new(move |info| {
            restore_terminal();
            chained(info);
        }));
        // From here on, dropping the guard undoes everything.
        let guard = TerminalGuard {
            old_signals,
            previous_hook: Some(previous),
        };
        enable_raw_mode()?;
        crossterm::execute!(io::stdout(), EnterAlternateScreen, crossterm::cursor::Hide)?;
        Ok(guard)
    }
}

impl Drop for TerminalGuard {
    fn drop(&mut self) {
        restore_terminal();
        if let Some(previous) = self.previous_hook.take() {
            // Not while panicking: the hook in place then is the one running.
            if !std::thread::panicking() {
                let _ = std::panic::take_hook();
                std::panic::set_hook(Box::new(move |info| previous(info)));
            }
        }
        for (sig, old) in self.old_signals.drain(..) {
            // SAFETY: restores the action that was in place before.
            let _ = unsafe { nix::sys::signal::sigaction(sig, &old) };
        }
    }
}

/// Runs the live view until the user quits, calling `source` for a new
/// snapshot every `state.interval` (not while paused), of the thread shown.
pub fn run_tui(
    mut source: impl FnMut(Option<u32>) -> Snapshot,
    mut state: ViewState,
) -> io::Result<()> {
    let _guard = TerminalGuard::install()?;
    let mut terminal = Terminal::new(CrosstermBackend::new(io::stdout()))?;
    terminal.clear()?;
    let mut snapshot = source(state.thread);
    state.saw(&snapshot);
    let mut next = Instant::now() + state.interval;
    loop {
        terminal.draw(|f| draw(f, &snapshot, &state))?;
        let mut refresh = false;
        while !refresh {
            if STOP.load(Ordering::SeqCst) {
                return Ok(());
            }
            let now = Instant::now();
            if now >= next && !state.paused {
                break;
            }
            let wait = if state.paused {
                Duration::from_millis(200)
            } else {
                next.saturating_duration_since(now)
                    .min(Duration::from_millis(200))
            };
            if event::poll(wait)? {
                match event::read()? {
                    TermEvent::Key(k) if k.kind != KeyEventKind::Release => {
                        match handle_key(&mut state, k.code, k.modifiers) {
                            None => return Ok(()),
                            Some(now) => refresh = now,
                        }
                        if !refresh {
                            terminal.draw(|f| draw(f, &snapshot, &state))?;
                        }
                    }
                    TermEvent::Resize(..) => {
                        terminal.draw(|f| draw(f, &snapshot, &state))?;
                    }
                    _ => {}
                }
            }
        }
        snapshot = source(state.thread);
        state.saw(&snapshot);
        next = Instant::now() + state.interval;
    }
}
