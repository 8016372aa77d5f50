//! A NATS URL as an operator writes it: its servers, its credentials
//! (user info, read as nats.go reads it) and its printable form.

use super::{NatsAuth, NatsOptionsError};

/// `url` as it may be printed: the password of a `user:password@` and a
/// token of a `token@` user info replaced by `***`, in each server of a
/// comma-separated list. Errors and logs name the server the router tried;
/// a secret written into the URL must not reach them (operator guide,
/// "Secrets are never printed"). Anything without user info is returned as
/// given.
///
/// ```
/// use kv_router_glue::redact_url;
/// assert_eq!(redact_url("nats://router:pw@n1:4222"), "nats://router:***@n1:4222");
/// assert_eq!(redact_url("tls://t0k3n@n1"), "tls://***@n1");
/// assert_eq!(redact_url("nats://n1:4222"), "nats://n1:4222");
/// ```
pub fn redact_url(url: &str) -> String {
    url.split(',').map(redact_one).collect::<Vec<_>>().join(",")
}

fn redact_one(server: &str) -> String {
    let (scheme, rest) = match server.split_once("://") {
        Some((s, r)) => (Some(s), r),
        None => (None, server),
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    // The last `@` ends the user info (a password may itself hold one).
    let Some(at) = authority.rfind('@') else {
        return server.to_string();
    };
    let info = match authority[..at].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_string(),
    };
    let scheme = scheme.map(|s| format!("{s}://")).unwrap_or_default();
    format!("{scheme}{info}@{}{tail}", &authority[at + 1..])
}

/// The NATS servers of `url`: one server URL or a comma-separated list of
/// them (`nats://n1:4222,nats://n2:4222`; spaces around each are ignored),
/// each `nats://`, `tls://`, `ws://` or `wss://` (no scheme: `nats://`).
/// The client connects to one of them and moves to another when it is
/// lost; it also learns the cluster's other servers from the one it reaches.
///
/// ```
/// use kv_router_glue::nats_server_addrs;
/// assert_eq!(nats_server_addrs("nats://n1:4222, n2:4223").unwrap().len(), 2);
/// assert!(nats_server_addrs("nats://n1:4222,,nats://n2:4222").is_err());
/// assert!(nats_server_addrs("http://n1:4222").is_err());
/// ```
///
/// # Errors
/// Why the list or one of its servers is refused (an empty entry, an
/// unknown scheme, no host), naming the entry with any password replaced
/// by `***`.
pub fn nats_server_addrs(url: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    url.split(',')
        .map(|one| {
            let one = one.trim();
            let named = |why: String| {
                if url.contains(',') {
                    format!("server {:?}: {why}", redact_one(one))
                } else {
                    why
                }
            };
            if one.is_empty() {
                return Err(named("is empty".into()));
            }
            let addr: async_nats::ServerAddr = one.parse().map_err(|e| named(format!("{e}")))?;
            if addr.host().is_empty() {
                return Err(named("has no host".into()));
            }
            Ok(addr)
        })
        .collect()
}

/// The credentials written into `url`'s user info, by the NATS convention
/// (the nats CLI, nats.go, nats.py): `user:password@` is
/// [`NatsAuth::UserPassword`], also with an empty password (`user:@`, as
/// nats.go reads it), a user alone (`token@`) is [`NatsAuth::Token`], none
/// (or an empty user and password, `:@`) is [`NatsAuth::None`]. Both parts
/// are percent-decoded (`p%40ss` is `p@ss`); only a literal `:` separates
/// them, so `u%3Ap@` is the token `u:p`. async-nats 0.51 parses the user
/// info but never sends it, so a URL with credentials was refused by an
/// authenticating server ("authorization violation") unless they are
/// taken from it here.
///
/// # Errors
/// As [`NatsOptions::with_url_credentials`](super::NatsOptions::with_url_credentials), but for credentials given
/// both ways (`nats_url`); no message shows a secret.
pub(super) fn url_auth(url: &str) -> Result<NatsAuth, NatsOptionsError> {
    let refused = |reason: String| NatsOptionsError {
        field: "nats_url",
        reason,
    };
    let decoded = |part: &str, what: &str| {
        percent_encoding::percent_decode_str(part)
            .decode_utf8()
            .map(|p| p.into_owned())
            .map_err(|_| {
                refused(format!(
                    "has a {what} that is not UTF-8 once percent-decoded"
                ))
            })
    };
    let mut found: Option<NatsAuth> = None;
    let servers = nats_server_addrs(url).map_err(refused)?;
    // nats_server_addrs parses the same comma-separated entries, in order.
    for (text, server) in url.split(',').zip(servers) {
        // `ServerAddr` gives both parts still percent-encoded (`url::Url`).
        // The url crate drops an empty password, so `u:@host` would read
        // as the token `u@host`; nats.go reads it as user `u` with an empty
        // password, which only the raw text's `:` tells apart.
        let password = match server.password() {
            Some(p) => Some(p),
            None if server.username().is_some() && raw_user_info(text).contains(':') => Some(""),
            None => None,
        };
        let auth = match (server.username(), password) {
            (None, None) => NatsAuth::None,
            (Some(user), Some(password)) => NatsAuth::UserPassword {
                user: decoded(user, "user")?,
                password: decoded(password, "password")?,
            },
            (Some(token), None) => NatsAuth::Token(decoded(token, "token")?),
            (None, Some(_)) => {
                return Err(refused(
                    "has a password but no user (`user:password@host`)".into(),
                ))
            }
        };
        match &found {
            None => found = Some(auth),
            Some(first) if *first == auth => {}
            Some(_) => {
                return Err(refused(
                    "has servers with different credentials: give every server the \
                     same user info, or none"
                        .into(),
                ))
            }
        }
    }
    Ok(found.unwrap_or_default())
}

/// The user info of one server entry of a NATS URL as written (still
/// percent-encoded): the text between `//` (or the entry's start when it
/// has no scheme) and the authority's last `@` (a password may hold a
/// literal `@`, as the url crate reads it); empty when it has none.
fn raw_user_info(server: &str) -> &str {
    let server = server.trim();
    let rest = server.split_once("://").map_or(server, |(_, r)| r);
    let authority = &rest[..rest.find(['/', '?', '#']).unwrap_or(rest.len())];
    authority.rfind('@').map_or("", |at| &authority[..at])
}
