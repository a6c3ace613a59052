//! Logging a child's stderr: line by line with its pid, each line capped in length, and the
//! whole stream capped in volume by a token bucket of lines and bytes per second.
//!
//! Trust model: the child is not trusted once it has seen a request, and a compromised child
//! could otherwise flood the daemon's log (and its disk). A legitimate child writes a line or
//! two, before it exits on a framing violation; the bucket lets short bursts through whole.
//! Lines over the budget are counted and dropped; each episode of dropping is logged twice,
//! when it starts and with the count of dropped lines when it ends (or at EOF).
//!
//! Pure: the caller feeds bytes and the time ([`StderrLog::feed`]), so the limits are tested
//! without a process.

use std::time::{Duration, Instant};

/// Longest stderr line logged; the rest of a longer line is dropped.
pub(crate) const MAX_STDERR_LINE: usize = 4096;
/// Lines a child may log in a burst, and per second in the long run.
const BURST_LINES: f64 = 100.0;
const LINES_PER_SECOND: f64 = 10.0;
/// Bytes a child may log in a burst, and per second in the long run.
const BURST_BYTES: f64 = 64.0 * 1024.0;
const BYTES_PER_SECOND: f64 = 8.0 * 1024.0;

/// A token bucket of lines and bytes.
#[derive(Debug)]
struct Budget {
    lines: f64,
    bytes: f64,
    refilled: Instant,
}

impl Budget {
    fn new(now: Instant) -> Budget {
        Budget { lines: BURST_LINES, bytes: BURST_BYTES, refilled: now }
    }

    /// Whether a line of `len` bytes may be logged now; takes its tokens if so.
    fn admit(&mut self, now: Instant, len: usize) -> bool {
        let elapsed = now.saturating_duration_since(self.refilled).as_secs_f64();
        self.refilled = now.max(self.refilled);
        self.lines = (self.lines + elapsed * LINES_PER_SECOND).min(BURST_LINES);
        self.bytes = (self.bytes + elapsed * BYTES_PER_SECOND).min(BURST_BYTES);
        let cost = len.max(1) as f64;
        if self.lines >= 1.0 && self.bytes >= cost {
            self.lines -= 1.0;
            self.bytes -= cost;
            true
        } else {
            false
        }
    }
}

/// What to do with one complete line.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Event {
    /// Log the line (lossy UTF-8, trailing whitespace trimmed; `truncated` when it was cut).
    Line { text: String, truncated: bool },
    /// The budget ran out: lines are dropped from now on.
    DroppingStarted,
    /// Lines were dropped and the budget admits lines again (or the stream ended).
    Dropped { lines: u64 },
}

/// Splits a child's stderr into lines and applies the budget.
pub(crate) struct StderrLog {
    line: Vec<u8>,
    truncated: bool,
    budget: Budget,
    dropped: u64,
    dropping: bool,
}

impl StderrLog {
    pub(crate) fn new(now: Instant) -> StderrLog {
        StderrLog {
            line: Vec::with_capacity(256),
            truncated: false,
            budget: Budget::new(now),
            dropped: 0,
            dropping: false,
        }
    }

    /// Feeds bytes read at `now`; `emit` gets the events in order.
    pub(crate) fn feed(&mut self, now: Instant, bytes: &[u8], mut emit: impl FnMut(Event)) {
        for &byte in bytes {
            if byte == b'\n' {
                self.finish_line(now, &mut emit);
            } else if self.line.len() < MAX_STDERR_LINE {
                self.line.push(byte);
            } else {
                self.truncated = true;
            }
        }
    }

    /// The stream ended: logs a last unterminated line and the count of a dropping episode.
    pub(crate) fn end(&mut self, now: Instant, mut emit: impl FnMut(Event)) {
        if !self.line.is_empty() {
            self.finish_line(now, &mut emit);
        }
        if self.dropped > 0 {
            emit(Event::Dropped { lines: self.dropped });
            self.dropped = 0;
        }
    }

    fn finish_line(&mut self, now: Instant, emit: &mut impl FnMut(Event)) {
        let len = self.line.len();
        if self.budget.admit(now, len) {
            if self.dropping {
                self.dropping = false;
                emit(Event::Dropped { lines: self.dropped });
                self.dropped = 0;
            }
            let text = String::from_utf8_lossy(&self.line).trim_end().to_string();
            emit(Event::Line { text, truncated: self.truncated });
        } else {
            if !self.dropping {
                self.dropping = true;
                emit(Event::DroppingStarted);
            }
            self.dropped += 1;
        }
        self.line.clear();
        self.truncated = false;
    }
}

/// How long after the child's exit its stderr is still read (a descendant could keep it open).
pub(crate) const DRAIN_AFTER_EXIT: Duration = Duration::from_secs(1);

#[cfg(test)]
mod tests {
    use super::*;

    fn run(log: &mut StderrLog, now: Instant, bytes: &[u8]) -> Vec<Event> {
        let mut events = Vec::new();
        log.feed(now, bytes, |e| events.push(e));
        events
    }

    fn lines(events: &[Event]) -> usize {
        events.iter().filter(|e| matches!(e, Event::Line { .. })).count()
    }

    #[test]
    fn lines_are_split_and_capped_in_length() {
        let now = Instant::now();
        let mut log = StderrLog::new(now);
        let mut input = b"first\nsec".to_vec();
        let events = run(&mut log, now, &input);
        assert_eq!(events, vec![Event::Line { text: "first".into(), truncated: false }]);
        input = vec![b'x'; MAX_STDERR_LINE * 2];
        input.push(b'\n');
        let events = run(&mut log, now, &input);
        let [Event::Line { text, truncated: true }] = &events[..] else { panic!("{events:?}") };
        assert_eq!(text.len(), MAX_STDERR_LINE);
        assert!(text.starts_with("secx"));
    }

    #[test]
    fn a_flood_is_capped_in_volume_and_the_drop_is_counted_once_per_episode() {
        let start = Instant::now();
        let mut log = StderrLog::new(start);
        // A million lines at once: the burst passes, the rest is dropped and counted.
        let flood = b"flood line\n".repeat(1_000_000);
        let events = run(&mut log, start, &flood);
        assert_eq!(lines(&events), BURST_LINES as usize);
        assert_eq!(events.iter().filter(|e| **e == Event::DroppingStarted).count(), 1);
        assert!(!events.iter().any(|e| matches!(e, Event::Dropped { .. })));

        // A second later the budget admits lines again; the episode ends with its count.
        let later = start + Duration::from_secs(1);
        let events = run(&mut log, later, b"after\n");
        assert_eq!(events[0], Event::Dropped { lines: 1_000_000 - BURST_LINES as u64 });
        assert_eq!(events[1], Event::Line { text: "after".into(), truncated: false });
    }

    #[test]
    fn long_lines_are_capped_by_bytes_too() {
        let start = Instant::now();
        let mut log = StderrLog::new(start);
        let mut long = vec![b'y'; MAX_STDERR_LINE];
        long.push(b'\n');
        let events = run(&mut log, start, &long.repeat(50));
        // 64 KiB of budget: 16 lines of 4 KiB, not 50.
        assert_eq!(lines(&events), (BURST_BYTES as usize) / MAX_STDERR_LINE);
        let mut events = Vec::new();
        log.end(start, |e| events.push(e));
        assert_eq!(events, vec![Event::Dropped { lines: 50 - 16 }]);
    }
}
