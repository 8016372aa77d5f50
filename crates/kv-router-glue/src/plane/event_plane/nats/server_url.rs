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
/// // A secret holding `/`, `?`, `#` or `,` (which must be percent-encoded
/// // to be used) is hidden all the same.
/// assert_eq!(redact_url("nats://u:a/b,c@n1:4222"), "nats://u:***@n1:4222");
/// assert_eq!(redact_url("nats://n1,nats://t#k@n2"), "nats://n1,nats://***@n2");
/// // One holding `://` too, user name and all.
/// assert_eq!(redact_url("nats://u:a://b@n1"), "nats://***@n1");
/// ```
pub fn redact_url(url: &str) -> String {
    // On the raw text, not on parsed entries: a secret may hold a `,`, `/`,
    // `?` or `#` that a parser would cut it at, leaving the `@` beyond the
    // cut and the secret shown (trial h39, 3). Each entry's user info runs
    // from its `://` (or the text's start, or the `,` before a scheme-less
    // entry) to the last `@` before the next entry's scheme: hiding too much
    // of a malformed URL is fine, showing a secret is not.
    // A `://` starts an entry only when it is the first one, or a bare
    // scheme name follows the last `,` before it: a `://` inside a secret
    // (`nats://u:SECa://RETb@h`) must not end the secret's span, which
    // showed `SECa` (trial h42, 2).
    let mut entries: Vec<(usize, usize)> = Vec::new(); // (text start, after `://`)
    for (i, _) in url.match_indices("://") {
        let text_start = url[..i].rfind(',').map(|c| c + 1);
        let after_prev = entries.last().map_or(0, |&(_, s)| s);
        // The first one too: in a scheme-less `router:SECa://RETb@h` the
        // `://` is the secret's (trial h44, 5).
        let t = text_start.unwrap_or(0);
        if (entries.is_empty() || t > after_prev) && is_scheme(url[t..i].trim()) {
            entries.push((t, i + 3));
        }
    }
    let mut out = String::with_capacity(url.len());
    // Scheme-less text before the first scheme (or the whole text without one).
    let lead_end = entries.first().map_or(url.len(), |&(t, _)| t);
    redact_span(&url[..lead_end], &mut out);
    for (k, &(text_start, start)) in entries.iter().enumerate() {
        // Each entry's text ends where the next one's starts, else at the end.
        let end = entries.get(k + 1).map_or(url.len(), |&(t, _)| t);
        out.push_str(&url[text_start..start]);
        redact_span(&url[start..end], &mut out);
    }
    out
}

/// Whether `s` is a URL scheme name (RFC 3986: a letter, then letters,
/// digits, `+`, `-` or `.`).
fn is_scheme(s: &str) -> bool {
    let mut chars = s.chars();
    chars.next().is_some_and(|c| c.is_ascii_alphabetic())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '+' | '-' | '.'))
}

/// Whether `authority` (an entry's text before its first `/`, `?` or
/// `#`) is an IP address with an optional numeric port (`127.0.0.1:4222`,
/// `[::1]`). An `@` after it then belongs to a path, query or fragment
/// (`ws://127.0.0.1:80/p@th`, trial h42, 12), as RFC 3986 reads it, and
/// not to user info cut by a raw `/`, `?` or `#` in a secret: that reading
/// would make the IP address a user name or the start of a token. After a
/// host name it stays ambiguous (`nats://admin:1234/abcd@host` is user
/// `admin` with password `1234/abcd` as well as host `admin`, port `1234`),
/// so the `@` is taken for a secret's: hidden, and refused.
fn is_ip_authority(authority: &str) -> bool {
    let host = match authority.rsplit_once(':') {
        // `[::1]:80`, `127.0.0.1:80`; not the last group of a bare `[::1]`.
        Some((host, port))
            if !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (host.ends_with(']') || !host.contains(':')) =>
        {
            host
        }
        _ => authority,
    };
    match host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        Some(v6) => v6.parse::<std::net::Ipv6Addr>().is_ok(),
        None => host.parse::<std::net::Ipv4Addr>().is_ok(),
    }
}

/// Appends `span` to `out` with everything before its last `@` hidden
/// (`user:***`, or `***` for a token); an `@` in the path, query or
/// fragment after an IP address ([`is_ip_authority`]) is no user info's.
fn redact_span(span: &str, out: &mut String) {
    if let Some(cut) = span.find(['/', '?', '#', ',']) {
        if !span[cut..].starts_with(',') && is_ip_authority(&span[..cut]) {
            redact_span(&span[..cut], out);
            // The path runs to the next `,`, where a list's next
            // (scheme-less) entry starts, redacted as its own.
            match span[cut..].find(',') {
                Some(comma) => {
                    out.push_str(&span[cut..cut + comma + 1]);
                    redact_span(&span[cut + comma + 1..], out);
                }
                None => out.push_str(&span[cut..]),
            }
            return;
        }
    }
    match span.rfind('@') {
        Some(at) => {
            // A user name is shown only when it cannot be part of a cut
            // secret or of another entry (no `,`, `/`, `?` or `#` in it), nor
            // the start of a token holding `://` (`SEC://RET`).
            let info = &span[..at];
            match info.split_once(':') {
                Some((user, _))
                    if !user.contains([',', '/', '?', '#']) && !info.contains("://") =>
                {
                    out.push_str(user);
                    out.push_str(":***");
                }
                _ => out.push_str("***"),
            }
            out.push_str(&span[at..]);
        }
        None => {
            // No `@`, but a "port" that is no number: the part of a secret
            // before a `,` that a list split at (`nats://u:SECa,c://RETb@h`,
            // trial h44, 5). A host is shown, never what follows its `:`.
            let authority_end = span.find(['/', '?', '#']).unwrap_or(span.len());
            let authority = span[..authority_end].trim_end_matches([',', ' ']);
            match authority.rsplit_once(':') {
                Some((_, port))
                    if !authority.ends_with(']')
                        && !port.is_empty()
                        && !port.bytes().all(|b| b.is_ascii_digit()) =>
                {
                    out.push_str("***");
                    out.push_str(&span[authority.len()..]);
                }
                _ => out.push_str(span),
            }
        }
    }
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
    let entries: Vec<&str> = url.split(',').map(str::trim).collect();
    let n = entries.len();
    // A scheme-less entry with user info after one with a scheme is a
    // secret cut at a `,` (`nats://u:p,q@host`), not a second server: its
    // first part would be connected to as a host (and looked up in DNS).
    let schemed = entries.iter().any(|e| e.contains("://"));
    entries
        .iter()
        .enumerate()
        .map(|(i, &one)| {
            // By position, not by text: the text of a cut entry may be part
            // of a secret with no `@` to redact it by.
            let named = |why: String| {
                if n > 1 {
                    format!("server {} of {n}: {why}", i + 1)
                } else {
                    why
                }
            };
            if one.is_empty() {
                return Err(named("is empty".into()));
            }
            let (scheme, rest) = one.split_once("://").unwrap_or(("nats", one));
            let cut = rest.find(['/', '?', '#']).unwrap_or(rest.len());
            // The url crate reads a `\` as a `/` in a ws:// or wss:// URL (a
            // WHATWG "special" scheme): a raw one in a secret made its first
            // part the host, looked up in DNS and logged at debug level
            // (trial h47, 5). Not in nats:// or tls://, where it is text.
            let special = scheme.eq_ignore_ascii_case("ws") || scheme.eq_ignore_ascii_case("wss");
            if special && rest[..cut].contains('\\') {
                return Err(named(
                    "has a `\\` before its host, which a ws:// or wss:// URL reads as a `/`: \
                     percent-encode it in a password or token (`%5C`)"
                        .into(),
                ));
            }
            if rest[cut..].contains('@') && !is_ip_authority(&rest[..cut]) {
                // Either reading is possible (`redact_url` hides it as a
                // secret's); each has its percent-encoding.
                return Err(named(
                    "has an `@` after a `/`, `?` or `#`: percent-encode a `/`, `?` or `#` \
                     in a password or token (`%2F`, `%3F`, `%23`), or an `@` in a path, \
                     query or fragment (`%40`)"
                        .into(),
                ));
            }
            if schemed && !one.contains("://") && one.contains('@') {
                return Err(named(
                    "has user info but no scheme after a server with one: a `,` in a \
                     password or token must be percent-encoded (`%2C`)"
                        .into(),
                ));
            }
            let addr: async_nats::ServerAddr = one.parse().map_err(|e| named(format!("{e}")))?;
            if addr.host().is_empty() {
                return Err(named("has no host".into()));
            }
            Ok(addr)
        })
        .collect()
}

/// [`nats_server_addrs`] without their user info: what the client is given
/// to connect to. The credentials are taken from the URL into the connect
/// options ([`url_auth`]); left in the addresses, they were printed in
/// clear by async-nats' own debug lines (`attempting connection ...
/// password: Some(..)`, trial h39, 4) although it never sends them.
///
/// # Errors
/// As [`nats_server_addrs`].
pub(crate) fn connect_addrs(url: &str) -> Result<Vec<async_nats::ServerAddr>, String> {
    nats_server_addrs(url)?
        .into_iter()
        .map(|addr| {
            let mut u = addr.into_inner();
            // Both only fail for URLs without a host, which
            // nats_server_addrs refused.
            let _ = u.set_password(None);
            let _ = u.set_username("");
            async_nats::ServerAddr::from_url(u).map_err(|e| e.to_string())
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

#[cfg(test)]
mod tests {
    use super::*;

    /// Trial h39, 3: a `/`, `?`, `#` or `,` in a password or token left it
    /// in clear in every message naming the URL, and with `/` or `#` the
    /// part before it was connected to as a host (a DNS lookup of a secret).
    const CUT_SECRETS: [&str; 14] = [
        "nats://router:SEC/RET123@127.0.0.1:14323",
        "nats://router:SEC,RET123@127.0.0.1:14323",
        "nats://router:SEC?RET123@127.0.0.1:14323",
        "nats://router:SEC#RET123@127.0.0.1:14323",
        "nats://SEC/RET123@127.0.0.1:14324",
        "nats://SEC#RET123@127.0.0.1:14324",
        "nats://SEC,RET123@127.0.0.1:14324",
        "nats://n1:4222,tls://router:SEC/RET123@n2:4222",
        // Trial h44, 5: a `,`, a word and `://` inside it; no scheme.
        "nats://router:SEC,c://RET123@127.0.0.1:1",
        "nats://router:SEC,nats://RET123@127.0.0.1:1",
        "router:SEC://RET123@127.0.0.1:1",
        // Trial h42, 2: a `://` inside the secret.
        "nats://router:SEC://RET123@127.0.0.1:1",
        "nats://SEC://RET123@127.0.0.1:1",
        "nats://n1:4222, tls://router:SEC://RET123@n2:4222",
    ];

    #[test]
    fn a_secret_holding_a_separator_is_hidden_and_never_connected_to() {
        for url in CUT_SECRETS {
            let shown = redact_url(url);
            assert!(
                !shown.contains("SEC") && !shown.contains("RET123"),
                "{url} -> {shown}"
            );
            let why = nats_server_addrs(url).expect_err(url);
            assert!(
                !why.contains("SEC") && !why.contains("RET123"),
                "{url}: {why}"
            );
        }
        assert_eq!(
            redact_url(CUT_SECRETS[0]),
            "nats://router:***@127.0.0.1:14323"
        );
        assert_eq!(redact_url(CUT_SECRETS[4]), "nats://***@127.0.0.1:14324");
        assert_eq!(
            redact_url(CUT_SECRETS[7]),
            "nats://n1:4222,tls://router:***@n2:4222"
        );
        assert_eq!(redact_url(CUT_SECRETS[11]), "nats://***@127.0.0.1:1");
        assert_eq!(redact_url(CUT_SECRETS[12]), "nats://***@127.0.0.1:1");
        assert_eq!(
            redact_url(CUT_SECRETS[13]),
            "nats://n1:4222, tls://***@n2:4222"
        );
        assert!(nats_server_addrs(CUT_SECRETS[0])
            .unwrap_err()
            .contains("percent-encode a `/`, `?` or `#` in a password or token"));
        assert!(nats_server_addrs(CUT_SECRETS[6])
            .unwrap_err()
            .contains("`%2C`"));
    }

    /// Trial h47, 5: a `\` in a ws:// secret made its first part the host
    /// (the url crate reads it as `/` there), looked up in DNS and logged.
    /// Refused without showing it; in nats:// it is text and stays allowed.
    #[test]
    fn a_backslash_in_a_ws_secret_is_refused_unseen() {
        for url in [
            "ws://tok\\en17@127.0.0.1:24222",
            "wss://u:SEC\\RET123@127.0.0.1:1",
        ] {
            let why = nats_server_addrs(url).expect_err(url);
            assert!(why.contains("`%5C`"), "{why}");
            assert!(!why.contains("en17") && !why.contains("RET123"), "{why}");
            let shown = redact_url(url);
            assert!(
                !shown.contains("en17") && !shown.contains("RET123"),
                "{shown}"
            );
        }
        let ok = nats_server_addrs("nats://u:p\\q@127.0.0.1:1").unwrap();
        assert_eq!(ok[0].host(), "127.0.0.1");
    }

    /// Trial h42, 12: an `@` in a ws path, a query or a fragment after an
    /// IP address was taken for user info holding a `/`, `?` or `#`: the
    /// URL refused, and printed with its port hidden
    /// (`ws://127.0.0.1:***@th`). After a host name it is still ambiguous
    /// (user info or path), so it is hidden and refused, the refusal naming
    /// both percent-encodings.
    #[test]
    fn an_at_in_the_path_after_an_ip_address_is_no_user_info() {
        for (url, host, port) in [
            ("ws://127.0.0.1:1/p@th", "127.0.0.1", 1),
            ("ws://127.0.0.1:1/nats?x=a@b", "127.0.0.1", 1),
            ("nats://127.0.0.1:1/#frag@x", "127.0.0.1", 1),
            ("wss://[::1]:443/a@b", "::1", 443),
            ("ws://10.0.0.7:80/p@th", "10.0.0.7", 80),
            ("ws://127.0.0.1:1/p@th, nats://n2:4222", "127.0.0.1", 1),
        ] {
            assert_eq!(redact_url(url), url);
            let addrs = nats_server_addrs(url).expect(url);
            let first = &addrs[0];
            assert_eq!(
                (first.host().trim_matches(['[', ']']), first.port()),
                (host, port)
            );
            assert_eq!(url_auth(url).unwrap(), NatsAuth::None, "{url}");
        }
        assert_eq!(redact_url("ws://10.0.0.7/p@th"), "ws://10.0.0.7/p@th");
        // A secret in a later scheme-less entry stays hidden.
        assert_eq!(
            redact_url("ws://127.0.0.1:1/p@th,u:SECRET@h2"),
            "ws://127.0.0.1:1/p@th,u:***@h2"
        );
        // The same shapes after a host name: a user `admin` with the
        // password `1234/abcd` as well.
        for (url, shown) in [
            ("nats://admin:1234/abcd@h", "nats://admin:***@h"),
            ("ws://nats.example:443/p@th", "ws://nats.example:***@th"),
            (
                "ws://127.0.0.1.example:1/p@th",
                "ws://127.0.0.1.example:***@th",
            ),
        ] {
            assert_eq!(redact_url(url), shown);
            let why = nats_server_addrs(url).unwrap_err();
            assert!(
                why.contains("`%2F`") && why.contains("`%40`") && !why.contains("1234"),
                "{url}: {why}"
            );
        }
        assert!(is_ip_authority("[::1]") && is_ip_authority("[::1]:80"));
        assert!(
            !is_ip_authority("::1") && !is_ip_authority("127.0.0.1:") && !is_ip_authority("u:1")
        );
    }

    #[test]
    fn well_formed_urls_keep_their_text_and_entries_are_named_by_position() {
        for url in ["nats://n1:4222", "nats://n1:4222, n2:4223", "[::1]:4222"] {
            assert_eq!(redact_url(url), url);
        }
        assert_eq!(redact_url("u:p@n1:4222"), "u:***@n1:4222");
        assert_eq!(
            redact_url("nats://a:x@n1,nats://a:x@n2"),
            "nats://a:***@n1,nats://a:***@n2"
        );
        assert_eq!(
            nats_server_addrs("nats://n1:4222,,nats://n2:4222").unwrap_err(),
            "server 2 of 3: is empty"
        );
        assert_eq!(
            nats_server_addrs("nats://u:p%2Fq@n1:4222").unwrap().len(),
            1
        );
    }
}
