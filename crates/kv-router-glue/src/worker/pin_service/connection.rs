//! One accepted connection of the pin service: its frames served in order
//! ([`serve_connection`]), the pins it holds ([`ConnPins`], released when
//! it ends), and its side of the idle-flag race with the accept thread's
//! eviction at the connection limit ([`reclaim_after_read`] against
//! [`claim_for_eviction`]: exactly one wins).

use super::*;

/// The connection thread's side of the race with [`super::evict_idle`], after its
/// read returned: true when it may serve what it read. A connection that
/// was not idle (`eligible` false) cannot have been taken; an idle one is
/// the thread's again only if it clears the flag before an eviction does
/// (`swap` against the eviction's `compare_exchange`: one of them sees
/// `true`).
pub(super) fn reclaim_after_read(idle: &AtomicBool, eligible: bool) -> bool {
    !eligible || idle.swap(false, Ordering::SeqCst)
}

/// [`super::evict_idle`]'s side: takes an idle connection (true) or leaves a busy
/// one alone.
pub(super) fn claim_for_eviction(idle: &AtomicBool) -> bool {
    idle.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst)
        .is_ok()
}

struct Held {
    _pin: ManagerPin,
    granted: Instant,
    deadline: Instant,
}

/// One connection's pins; dropped (pins released) when the connection ends.
struct ConnPins<'a> {
    shared: &'a Shared,
    held: HashMap<u64, Held>,
    /// Pins dropped at `max_hold`, remembered so that their release reports
    /// `expired` (bounded: the oldest are forgotten first).
    expired: VecDeque<(u64, u64)>,
}

impl ConnPins<'_> {
    fn expire(&mut self, now: Instant) {
        let due: Vec<u64> = self
            .held
            .iter()
            .filter(|(_, h)| h.deadline <= now)
            .map(|(&id, _)| id)
            .collect();
        for id in &due {
            if let Some(h) = self.held.remove(id) {
                if self.expired.len() >= self.shared.config.max_pins.max(1) {
                    self.expired.pop_front();
                }
                self.expired
                    .push_back((*id, h.granted.elapsed().as_micros() as u64));
            }
        }
        self.shared
            .counters
            .expired
            .fetch_add(due.len() as u64, Ordering::SeqCst);
        self.shared.pins_dropped(due.len());
    }

    fn next_deadline(&self) -> Option<Instant> {
        self.held.values().map(|h| h.deadline).min()
    }
}

impl Drop for ConnPins<'_> {
    fn drop(&mut self) {
        let n = self.held.len();
        self.held.clear();
        self.shared
            .counters
            .dropped_on_disconnect
            .fetch_add(n as u64, Ordering::SeqCst);
        self.shared.pins_dropped(n);
    }
}

/// Ends a provisional admission (`Shared::provisional`) on every way out
/// of the key exchange.
struct ProvisionalSlot<'a>(&'a Shared);

impl Drop for ProvisionalSlot<'_> {
    fn drop(&mut self) {
        self.0.provisional.fetch_sub(1, Ordering::SeqCst);
    }
}

pub(super) fn serve_connection(
    s: &Shared,
    mut stream: PinStream,
    idle: &AtomicBool,
    admission: Admission,
) {
    let provisional = (admission == Admission::Provisional).then(|| ProvisionalSlot(s));
    if stream.is_tcp() {
        // `bind` refuses TCP without a key, so `auth` is set here.
        let Some(key) = &s.auth else { return };
        if let Err(e) = donor_handshake(&mut stream, key, s.config.io_timeout) {
            tracing::info!("pin service: TCP connection refused: {e}");
            s.counters.auth_refused.fetch_add(1, Ordering::SeqCst);
            return;
        }
    }
    if let Some(slot) = provisional {
        // Authenticated: now it may take an idle connection's place.
        drop(slot);
        if !super::evict_idle(s) {
            s.counters
                .connections_refused
                .fetch_add(1, Ordering::SeqCst);
            let _ = send(
                &mut stream,
                &refusal(
                    0,
                    PinRefusalReason::TooManyPins,
                    format!(
                        "connection limit {} reached (no idle connection to close)",
                        s.config.max_connections
                    ),
                ),
            );
            return;
        }
    }
    let mut pins = ConnPins {
        shared: s,
        held: HashMap::new(),
        expired: VecDeque::new(),
    };
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut frame_started: Option<Instant> = None;
    let mut served = false;
    loop {
        // Answer every whole frame already buffered.
        loop {
            match split_pin_frame(&buf) {
                Ok(Some((body, used))) => {
                    served = true;
                    let reply = handle(s, &mut pins, body);
                    buf.drain(..used);
                    if send(&mut stream, &reply).is_err() {
                        return;
                    }
                }
                Ok(None) => break,
                Err(e) => {
                    // The stream has no frame boundary any more: refuse and close.
                    s.counters.malformed.fetch_add(1, Ordering::SeqCst);
                    s.counters.refused.fetch_add(1, Ordering::SeqCst);
                    let _ = send(
                        &mut stream,
                        &refusal(0, PinRefusalReason::Malformed, e.to_string()),
                    );
                    return;
                }
            }
        }
        frame_started = if buf.is_empty() {
            None
        } else {
            frame_started.or(Some(Instant::now()))
        };
        if s.stopping.load(Ordering::SeqCst) {
            return;
        }
        let now = Instant::now();
        pins.expire(now);
        let mut wait = pins
            .next_deadline()
            .map(|d| d.saturating_duration_since(now));
        if let Some(t0) = frame_started {
            let left = (t0 + s.config.io_timeout).saturating_duration_since(now);
            if left.is_zero() {
                return; // a partial frame that never completes
            }
            wait = Some(wait.map_or(left, |w| w.min(left)));
        }
        // A zero timeout is an error for set_read_timeout; 1 ms is the floor.
        let _ = stream.set_read_timeout(wait.map(|w| w.max(Duration::from_millis(1))));
        // Idle: a frame served already (a kept connection, not one still
        // to send its first), no pin held or owed an `expired` answer, no
        // partial frame.
        let eligible = served && pins.held.is_empty() && pins.expired.is_empty() && buf.is_empty();
        idle.store(eligible, Ordering::SeqCst);
        let got = stream.read(&mut chunk);
        if !reclaim_after_read(idle, eligible) {
            // `evict_idle` took this connection while it waited: whatever the
            // read returned is not served (a grant would be dropped with the
            // connection right after); the target sees the connection end and
            // pins again on a new one.
            return;
        }
        match got {
            Ok(0) => return,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => return,
        }
    }
}

fn handle(s: &Shared, pins: &mut ConnPins<'_>, body: &[u8]) -> PinDonorMessage {
    let msg = match PinClientMessage::from_wire(body) {
        Ok(m) => m,
        Err(e) => {
            s.counters.malformed.fetch_add(1, Ordering::SeqCst);
            s.counters.refused.fetch_add(1, Ordering::SeqCst);
            return refusal(0, PinRefusalReason::Malformed, e.to_string());
        }
    };
    match msg {
        PinClientMessage::Pin(req) => {
            let r = pin(s, pins, &req);
            if matches!(r, PinDonorMessage::Refused(_)) {
                s.counters.refused.fetch_add(1, Ordering::SeqCst);
            }
            r
        }
        PinClientMessage::Release(rel) => {
            pins.expire(Instant::now());
            if let Some(h) = pins.held.remove(&rel.pin_id) {
                let held_us = h.granted.elapsed().as_micros() as u64;
                drop(h);
                s.pins_dropped(1);
                s.counters.released.fetch_add(1, Ordering::SeqCst);
                PinDonorMessage::Released(PinReleased {
                    pin_id: rel.pin_id,
                    held_us,
                    expired: false,
                })
            } else if let Some(i) = pins.expired.iter().position(|e| e.0 == rel.pin_id) {
                let (pin_id, held_us) = pins.expired.remove(i).unwrap_or_default();
                PinDonorMessage::Released(PinReleased {
                    pin_id,
                    held_us,
                    expired: true,
                })
            } else {
                s.counters.refused.fetch_add(1, Ordering::SeqCst);
                refusal(
                    0,
                    PinRefusalReason::UnknownPin,
                    format!("pin {} is not held on this connection", rel.pin_id),
                )
            }
        }
    }
}

fn pin(s: &Shared, pins: &mut ConnPins<'_>, req: &PinRequest) -> PinDonorMessage {
    let id = req.request_id;
    if s.draining.load(Ordering::SeqCst) {
        return refusal(
            id,
            PinRefusalReason::BankClosed,
            "the donor's pin service is shutting down".into(),
        );
    }
    if s.pins.fetch_add(1, Ordering::SeqCst) >= s.config.max_pins {
        s.pins_dropped(1);
        return refusal(
            id,
            PinRefusalReason::TooManyPins,
            format!("{} pins held, the limit", s.config.max_pins),
        );
    }
    let rank_block_bytes = s.bank.config().layout.rank_block_bytes() as u64;
    match s.bank.pin_hint(&req.to_hint(rank_block_bytes, &s.endpoint)) {
        Ok(p) => {
            let pin_id = s.next_pin.fetch_add(1, Ordering::SeqCst);
            let granted = Instant::now();
            // Hashed under the pin, before the target may read: the slots
            // cannot be reused meanwhile. Unreadable memory grants none
            // (the target then falls back, as for an older donor).
            let block_checksums = if req.want_block_checksums {
                crate::worker::block_checksums::of_pinned(&p, req, rank_block_bytes as usize)
                    .unwrap_or_default()
            } else {
                Vec::new()
            };
            pins.held.insert(
                pin_id,
                Held {
                    _pin: p,
                    granted,
                    deadline: granted + s.config.max_hold,
                },
            );
            s.counters.granted.fetch_add(1, Ordering::SeqCst);
            PinDonorMessage::Granted(PinGrant {
                request_id: id,
                pin_id,
                max_hold_ms: s.config.max_hold.as_millis() as u64,
                block_checksums,
            })
        }
        Err(e) => {
            s.pins_dropped(1);
            refusal(id, crate::error::bank_refusal_reason(&e), e.to_string())
        }
    }
}

pub(super) fn refusal(
    request_id: u64,
    reason: PinRefusalReason,
    detail: String,
) -> PinDonorMessage {
    PinDonorMessage::Refused(PinRefusal {
        request_id,
        reason,
        detail,
    })
}

pub(super) fn send(stream: &mut PinStream, msg: &PinDonorMessage) -> std::io::Result<()> {
    let frame = encode_pin_frame(msg).map_err(std::io::Error::other)?;
    stream.write_all(&frame)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_busy_connection_is_never_evicted_and_keeps_serving() {
        let idle = AtomicBool::new(false);
        assert!(!claim_for_eviction(&idle));
        assert!(reclaim_after_read(&idle, false));
    }

    #[test]
    fn an_idle_connection_taken_by_an_eviction_serves_nothing() {
        let idle = AtomicBool::new(true);
        assert!(claim_for_eviction(&idle));
        assert!(!reclaim_after_read(&idle, true));
        // Nor can a second eviction take it again.
        assert!(!claim_for_eviction(&idle));
    }

    /// The race itself: the connection thread marks itself idle, "reads",
    /// and reclaims, while an eviction tries to take it. In every round
    /// exactly one side wins: never a connection both served and closed
    /// (a pin granted on a dying connection), never one neither owns.
    #[test]
    fn exactly_one_side_wins_the_idle_flag_in_every_round() {
        use std::sync::Barrier;
        const ROUNDS: usize = 20_000;
        let idle = Arc::new(AtomicBool::new(false));
        let barrier = Arc::new(Barrier::new(2));
        let (i2, b2) = (idle.clone(), barrier.clone());
        let evictor = std::thread::spawn(move || {
            let mut won = Vec::with_capacity(ROUNDS);
            for _ in 0..ROUNDS {
                b2.wait(); // the flag is set
                won.push(claim_for_eviction(&i2));
                b2.wait(); // the round is over
            }
            won
        });
        let mut served = Vec::with_capacity(ROUNDS);
        for _ in 0..ROUNDS {
            idle.store(true, Ordering::SeqCst);
            barrier.wait();
            std::hint::spin_loop();
            served.push(reclaim_after_read(&idle, true));
            barrier.wait();
            assert!(!idle.load(Ordering::SeqCst), "the flag is left taken");
        }
        let evicted = evictor.join().unwrap();
        for (round, (s, e)) in served.iter().zip(&evicted).enumerate() {
            assert!(s ^ e, "round {round}: served {s}, evicted {e}");
        }
        // How often each side won (both usually do; which one wins a round
        // depends on scheduling, so neither count is asserted).
        let e = evicted.iter().filter(|e| **e).count();
        println!("evicted {e} of {ROUNDS} rounds, served {}", ROUNDS - e);
    }
}
