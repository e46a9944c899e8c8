//! The events of ring records that repeat, by token: a hit whose event any
//! equal record has too gets a token (see `Hit::repeats_as`), and each later
//! record equal to it is written as that event.

use rustc_hash::FxHashMap;

use pyprobe_recording::recording::{EventKind, FrameNumberHint, FrameRef};

/// Most events given tokens (distinct frames and first lines); hits of others
/// take the long way every time.
const MAX_TOKENS: usize = 1 << 18;

/// Events by token, and the token of each: a record kept again (after the
/// reader's table dropped it) gets its event's token back, so there are no
/// more tokens than events.
#[derive(Default)]
pub struct Repeats {
    events: Vec<Repeated>,
    /// Per token, its frame number in the recording's current chunk.
    hints: Vec<FrameNumberHint>,
    tokens: FxHashMap<Repeated, u32>,
}

/// The event of records that repeat: copied out per repeat, so plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Repeated {
    /// Nothing written (the file is filtered out).
    Nothing,
    Call(FrameRef),
    Resume(FrameRef),
    Return(FrameRef, u32),
    Line(FrameRef),
}

impl Repeats {
    /// The token of `kind` (`None`: an event that writes nothing), if it can
    /// have one: a call, a resume, a return or a line, while tokens last.
    pub fn token(&mut self, kind: Option<&EventKind>) -> Option<u32> {
        let repeated = match kind {
            None => Repeated::Nothing,
            Some(EventKind::Call { frame }) => Repeated::Call(*frame),
            Some(EventKind::Resume { frame }) => Repeated::Resume(*frame),
            Some(EventKind::Line { frame }) => Repeated::Line(*frame),
            Some(EventKind::Return { frame, first_line }) => Repeated::Return(*frame, *first_line),
            Some(_) => return None,
        };
        if let Some(&token) = self.tokens.get(&repeated) {
            return Some(token);
        }
        if self.events.len() >= MAX_TOKENS {
            return None;
        }
        let token = self.events.len() as u32;
        self.events.push(repeated);
        self.hints.push(FrameNumberHint::default());
        self.tokens.insert(repeated, token);
        Some(token)
    }

    /// The event of `token` (`None`: nothing to write, or no such token), and
    /// what the writer remembered of it last (see [`remember`](Self::remember)).
    #[inline]
    pub fn event(&self, token: u32) -> Option<(EventKind, FrameNumberHint)> {
        Some((self.kind(token)?, *self.hints.get(token as usize)?))
    }

    /// Keeps what the writer remembers of `token`'s event for its next repeat.
    #[inline]
    pub fn remember(&mut self, token: u32, hint: FrameNumberHint) {
        if let Some(kept) = self.hints.get_mut(token as usize) {
            *kept = hint;
        }
    }

    /// The event of `token` (`None`: nothing to write, or no such token).
    #[inline]
    pub fn kind(&self, token: u32) -> Option<EventKind> {
        match self.events.get(token as usize)? {
            Repeated::Call(frame) => Some(EventKind::Call { frame: *frame }),
            Repeated::Resume(frame) => Some(EventKind::Resume { frame: *frame }),
            Repeated::Return(frame, first_line) => Some(EventKind::Return {
                frame: *frame,
                first_line: *first_line,
            }),
            Repeated::Line(frame) => Some(EventKind::Line { frame: *frame }),
            Repeated::Nothing => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pyprobe_recording::recording::StrId;

    fn frame(line: u32) -> FrameRef {
        FrameRef {
            file: StrId(1),
            function: StrId(2),
            line,
        }
    }

    #[test]
    fn an_event_keeps_its_token_and_gives_itself_back() {
        let mut repeats = Repeats::default();
        let call = EventKind::Call { frame: frame(5) };
        let ret = EventKind::Return {
            frame: frame(6),
            first_line: 5,
        };
        let (a, b) = (repeats.token(Some(&call)), repeats.token(Some(&ret)));
        assert_ne!(a, b);
        assert_eq!(repeats.token(Some(&call)), a);
        assert_eq!(repeats.kind(a.unwrap()), Some(call));
        assert_eq!(repeats.kind(b.unwrap()), Some(ret));
        // A filtered file: a token that writes nothing.
        let nothing = repeats.token(None).expect("token");
        assert_eq!(repeats.kind(nothing), None);
        assert_eq!(repeats.kind(99), None);
    }

    #[test]
    fn only_calls_returns_and_lines_repeat_and_tokens_are_bounded() {
        let mut repeats = Repeats::default();
        assert_eq!(
            repeats.token(Some(&EventKind::GcStart { generation: 0 })),
            None
        );
        for line in 0..MAX_TOKENS as u32 {
            assert!(repeats
                .token(Some(&EventKind::Line { frame: frame(line) }))
                .is_some());
        }
        let past = EventKind::Call { frame: frame(1) };
        assert_eq!(repeats.token(Some(&past)), None);
        // Those with a token keep it.
        assert_eq!(
            repeats.token(Some(&EventKind::Line { frame: frame(7) })),
            Some(7)
        );
    }
}
