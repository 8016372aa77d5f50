//! [`PermissionRefusals`]: the permission violations the server reported
//! to one connection, for a caller waiting on a request the server dropped.
//!
//! NATS answers a publish its user may not make with
//! `-ERR 'Permissions Violation for Publish to "<subject>"'` on the
//! connection, not on the request: the request itself is dropped and its
//! caller only sees a timeout (10 s for a JetStream API request), so a
//! router without `$JS.API.STREAM.CREATE.KV_<bucket>` used to exit with
//! `timed out`. async-nats hands the `-ERR` to the connection's event
//! callback (`Event::ServerError(ServerError::Other(text))`), which
//! [`super::NatsOptions::connect_options`] sets; this feed carries it from
//! there to the waiting caller.

use std::sync::Arc;

use tokio::sync::broadcast;

/// Refusals held for listeners that fell behind: a request listens only
/// while it is in flight, and refusals come one per refused publish.
const REFUSALS_HELD: usize = 16;

/// The permission violations one connection was sent (module docs).
#[derive(Clone)]
pub(crate) struct PermissionRefusals {
    tx: broadcast::Sender<Arc<str>>,
}

impl std::fmt::Debug for PermissionRefusals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PermissionRefusals")
            .field("listeners", &self.tx.receiver_count())
            .finish()
    }
}

impl PermissionRefusals {
    /// A feed no connection reports to yet.
    pub(crate) fn new() -> Self {
        Self {
            tx: broadcast::channel(REFUSALS_HELD).0,
        }
    }

    /// Takes in one server error of the connection (the event callback's
    /// `ServerError::Other` text); only permission violations go on.
    pub(crate) fn note(&self, server_error: &str) {
        if server_error
            .to_ascii_lowercase()
            .contains("permissions violation")
        {
            // No listener: nobody waits on a request now; nothing to keep.
            let _ = self.tx.send(server_error.into());
        }
    }

    /// Starts listening; call it before sending the request whose refusal
    /// is awaited, so that a refusal coming back at once is not missed.
    pub(crate) fn listen(&self) -> RefusalListener {
        RefusalListener {
            rx: self.tx.subscribe(),
        }
    }
}

/// One caller's view of [`PermissionRefusals`] from when it listened.
pub(crate) struct RefusalListener {
    rx: broadcast::Receiver<Arc<str>>,
}

/// A publish the server refused: the subject, and the server's own text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// The subject refused, one of those waited for.
    pub(crate) subject: String,
    /// The server's `-ERR` text, as async-nats gives it.
    pub(crate) server: String,
}

impl RefusalListener {
    /// Waits for the server to refuse a publish to one of `subjects`
    /// (quoted in its text, as nats-server writes it); pending for ever if
    /// it never does, so race it against the request.
    pub(crate) async fn refused(&mut self, subjects: &[&str]) -> Refusal {
        loop {
            match self.rx.recv().await {
                Ok(text) => {
                    let found = subjects.iter().find(|s| text.contains(&format!("\"{s}\"")));
                    if let Some(subject) = found {
                        return Refusal {
                            subject: subject.to_string(),
                            server: text.to_string(),
                        };
                    }
                }
                // Refusals of other publishes crowded it out: the request
                // still times out, so nothing is lost but the early answer.
                Err(broadcast::error::RecvError::Lagged(_)) => {}
                Err(broadcast::error::RecvError::Closed) => std::future::pending().await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CREATE: &str = "$JS.API.STREAM.CREATE.KV_kv_donors";

    #[tokio::test]
    async fn a_listener_gets_the_refusal_of_its_subjects_only() {
        let refusals = PermissionRefusals::new();
        let mut listener = refusals.listen();
        refusals.note("Permissions Violation for Publish to \"kv.ns.decode.kv_events\"");
        refusals.note("Maximum Payload Violation");
        refusals.note(&format!(
            "Permissions Violation for Publish to \"{CREATE}\""
        ));
        let got = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            listener.refused(&[CREATE, "$JS.API.INFO"]),
        )
        .await
        .unwrap();
        assert_eq!(
            got,
            Refusal {
                subject: CREATE.into(),
                server: format!("Permissions Violation for Publish to \"{CREATE}\""),
            }
        );
        // A subject that only starts like a waited one is not it.
        refusals.note(&format!(
            "Permissions Violation for Publish to \"{CREATE}2\""
        ));
        let other = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            listener.refused(&[CREATE]),
        )
        .await;
        assert!(other.is_err(), "{other:?}");
    }

    #[tokio::test]
    async fn a_refusal_before_listening_is_not_seen() {
        let refusals = PermissionRefusals::new();
        refusals.note(&format!(
            "Permissions Violation for Publish to \"{CREATE}\""
        ));
        let mut listener = refusals.listen();
        let got = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            listener.refused(&[CREATE]),
        )
        .await;
        assert!(got.is_err(), "{got:?}");
    }
}
