//! [`LogThrottle`]: at most one log line per period for one kind of
//! repeated event (a refused announcement, a message dropped for a slow
//! consumer), each line carrying how many were not logged since the one
//! before. Anyone who can publish can make such events arrive by the
//! thousand; the counters that go with them count every one.

use std::time::{Duration, Instant};

/// One kind of repeated log line, admitted at most once per `every`.
#[derive(Debug)]
pub(crate) struct LogThrottle {
    every: Duration,
    /// When the last line was logged, and events not logged since then.
    last: parking_lot::Mutex<Option<(Instant, u64)>>,
}

impl LogThrottle {
    /// A throttle admitting one line per `every` (`const`: usable in a
    /// `static` for process-wide events).
    pub(crate) const fn new(every: Duration) -> Self {
        Self {
            every,
            last: parking_lot::const_mutex(None),
        }
    }

    /// `Some(suppressed)` when the event seen at `now` is to be logged,
    /// `suppressed` being how many were not logged since the last line;
    /// `None` (and counted) inside `every` of that line.
    pub(crate) fn admit(&self, now: Instant) -> Option<u64> {
        let mut last = self.last.lock();
        match &mut *last {
            Some((at, n)) if now.saturating_duration_since(*at) < self.every => {
                *n += 1;
                None
            }
            slot => {
                let suppressed = slot.map_or(0, |(_, n)| n);
                *slot = Some((now, 0));
                Some(suppressed)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_per_period_with_the_count_between() {
        let every = Duration::from_secs(1);
        let t = LogThrottle::new(every);
        let t0 = Instant::now();
        assert_eq!(t.admit(t0), Some(0));
        for ms in [1, 10, 500, 999] {
            assert_eq!(t.admit(t0 + Duration::from_millis(ms)), None, "{ms} ms");
        }
        assert_eq!(t.admit(t0 + every), Some(4));
        assert_eq!(t.admit(t0 + every + Duration::from_millis(1)), None);
        assert_eq!(t.admit(t0 + 5 * every), Some(1));
    }
}
