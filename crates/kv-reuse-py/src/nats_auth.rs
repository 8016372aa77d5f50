//! How the wheel's own NATS connections (`WorkerPublisher.donor` /
//! `.target`, `DonorDirectory`, `RouterClient`) authenticate and encrypt:
//! the keyword arguments `user` + `password`, `token` or `creds` (a `.creds`
//! file), `tls_ca`, and `inbox_prefix` (its reply subjects' prefix), mapped
//! onto `kv_router_glue::NatsOptions` (and through its `connect_options`
//! onto async-nats, the one mapping of the project) so that a donor
//! agent's plane, directory and inventory connections, and the target's,
//! present the role's credentials to a server that enforces the
//! permissions of docs/nats-permissions.conf. Secrets are never put in an
//! error message.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::prelude::*;

use kv_router_glue::{NatsAuth, NatsOptions, NatsTls};

use crate::errors::bad_argument;

/// The credentials and TLS keyword arguments of one connecting call.
#[derive(Default)]
pub(crate) struct NatsCredentials {
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    pub creds: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub inbox_prefix: Option<String>,
}

impl NatsCredentials {
    /// The keyword arguments, in the order every constructor takes them.
    pub fn new(
        user: Option<String>,
        password: Option<String>,
        token: Option<String>,
        creds: Option<PathBuf>,
        tls_ca: Option<PathBuf>,
        inbox_prefix: Option<String>,
    ) -> Self {
        Self {
            user,
            password,
            token,
            creds,
            tls_ca,
            inbox_prefix,
        }
    }

    /// [`NatsCredentials::options`] as async-nats connect options
    /// (`NatsOptions::connect_options`: the `.creds` file read and parsed,
    /// the TLS file checked), for a client that connects itself.
    ///
    /// Raises as `options`, and `BadArgument` naming `creds` (unreadable or
    /// malformed file) or `tls_ca` (unreadable file).
    pub fn connect_options(
        self,
        name: &str,
        timeout: Duration,
    ) -> PyResult<async_nats::ConnectOptions> {
        self.options(name, timeout)?.connect_options().map_err(|e| {
            let argument = match e.field {
                "auth" => "creds",
                "tls.root_certificates" => "tls_ca",
                other => other,
            };
            bad_argument(argument, e.reason)
        })
    }

    /// The options of a connection named `name`, bounded by `timeout`.
    ///
    /// Raises `BadArgument` naming `inbox_prefix` (not a subject prefix),
    /// `password` (a `user` without one),
    /// `user` (a `password` without one), `token` or `creds` (given with
    /// another kind of credentials).
    pub fn options(self, name: &str, timeout: Duration) -> PyResult<NatsOptions> {
        if let Some(why) = self
            .inbox_prefix
            .as_deref()
            .and_then(kv_router_glue::inbox_prefix_problem)
        {
            return Err(bad_argument("inbox_prefix", why));
        }
        let auth = match (self.user, self.password, self.token, self.creds) {
            (None, None, None, None) => NatsAuth::None,
            (Some(user), Some(password), None, None) => NatsAuth::UserPassword { user, password },
            (None, None, Some(t), None) => NatsAuth::Token(t),
            (None, None, None, Some(path)) => NatsAuth::CredentialsFile(path),
            (Some(_), None, ..) => return Err(bad_argument("password", "required with `user`")),
            (None, Some(_), ..) => return Err(bad_argument("user", "required with `password`")),
            (_, _, Some(_), _) => {
                return Err(bad_argument(
                    "token",
                    "give one of `user`/`password`, `token` or `creds`",
                ))
            }
            (_, _, None, Some(_)) => {
                return Err(bad_argument(
                    "creds",
                    "give one of `user`/`password`, `token` or `creds`",
                ))
            }
        };
        Ok(NatsOptions {
            name: name.to_owned(),
            connect_timeout: timeout,
            auth,
            // A CA file turns TLS on by itself (`NatsTls::in_force`).
            tls: NatsTls {
                root_certificates: self.tls_ca,
                ..NatsTls::default()
            },
            inbox_prefix: self.inbox_prefix,
            ..NatsOptions::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn creds(user: Option<&str>, password: Option<&str>, token: Option<&str>) -> NatsCredentials {
        NatsCredentials {
            user: user.map(str::to_owned),
            password: password.map(str::to_owned),
            token: token.map(str::to_owned),
            ..NatsCredentials::default()
        }
    }

    #[test]
    fn each_kind_of_credentials_maps_to_its_auth() {
        let t = Duration::from_secs(1);
        let o = creds(None, None, None).options("x", t).unwrap();
        assert!(matches!(o.auth, NatsAuth::None) && !o.tls.in_force());
        let o = creds(Some("u"), Some("p"), None).options("x", t).unwrap();
        assert!(matches!(o.auth, NatsAuth::UserPassword { ref user, .. } if user == "u"));
        let o = creds(None, None, Some("t")).options("x", t).unwrap();
        assert!(matches!(o.auth, NatsAuth::Token(ref s) if s == "t"));
        let o = NatsCredentials {
            creds: Some("/d.creds".into()),
            tls_ca: Some("/ca.pem".into()),
            ..NatsCredentials::default()
        }
        .options("x", t)
        .unwrap();
        assert!(matches!(o.auth, NatsAuth::CredentialsFile(_)) && o.tls.in_force());
        assert_eq!(o.connect_timeout, t);
    }
    // Refusals (BadArgument naming the argument) are tested from Python:
    // tests/test_publisher.py, which needs an interpreter to raise them.
}
