//! How the wheel's own NATS connections (`WorkerPublisher.donor` /
//! `.target`, `DonorDirectory`, `RouterClient`) authenticate and encrypt:
//! the keyword arguments of [`NATS_KWARGS`], taken by every connecting
//! constructor as `**nats` and read here once ([`NatsCredentials::from_kwargs`]):
//! `user` + `password`, `token` or `creds` (a `.creds` file); `tls_ca` (PEM
//! CA file) and `tls_cert` + `tls_key` (a client certificate, for a server
//! that verifies clients: `nats-server --tlsverify`); `inbox_prefix` (its
//! reply subjects' prefix). They map onto `kv_router_glue::NatsOptions` (and
//! through its `connect_options` onto async-nats, the one mapping of the
//! project) so that a donor agent's plane, directory and inventory
//! connections, and the target's, present the role's credentials to a
//! server that enforces the permissions of docs/nats-permissions.conf.
//! Credentials may instead be written in `nats_url`
//! (`nats://user:password@host`, `nats://token@host`); that mapping takes
//! them from there and refuses them next to these keywords.
//! Secrets are never put in an error message.

use std::path::PathBuf;
use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use kv_router_glue::{NatsAuth, NatsOptions, NatsTls};

use crate::errors::bad_argument;

/// The NATS keyword arguments every connecting constructor takes (`**nats`).
pub(crate) const NATS_KWARGS: [&str; 8] = [
    "user",
    "password",
    "token",
    "creds",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "inbox_prefix",
];

/// The credentials and TLS keyword arguments of one connecting call.
#[derive(Default)]
pub(crate) struct NatsCredentials {
    pub user: Option<String>,
    pub password: Option<String>,
    pub token: Option<String>,
    pub creds: Option<PathBuf>,
    pub tls_ca: Option<PathBuf>,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub inbox_prefix: Option<String>,
}

impl NatsCredentials {
    /// The [`NATS_KWARGS`] among a constructor's `**nats` (`None`: none
    /// given). A value of `None` is the same as leaving the argument out.
    ///
    /// Raises `TypeError` for a keyword that is none of them (as Python
    /// does for an unknown keyword), `BadArgument` naming the argument when
    /// its value is not a `str` (paths: `str` or `os.PathLike`).
    pub fn from_kwargs(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Self> {
        let mut c = Self::default();
        let Some(kwargs) = kwargs else {
            return Ok(c);
        };
        for (key, value) in kwargs.iter() {
            let key: String = key.extract()?;
            if value.is_none() {
                continue;
            }
            let text = |v: &Bound<'_, PyAny>| {
                v.extract::<String>()
                    .map_err(|_| bad_argument(&key, "must be a str"))
            };
            let path = |v: &Bound<'_, PyAny>| {
                v.extract::<PathBuf>()
                    .map_err(|_| bad_argument(&key, "must be a path (str or os.PathLike)"))
            };
            match key.as_str() {
                "user" => c.user = Some(text(&value)?),
                "password" => c.password = Some(text(&value)?),
                "token" => c.token = Some(text(&value)?),
                "inbox_prefix" => c.inbox_prefix = Some(text(&value)?),
                "creds" => c.creds = Some(path(&value)?),
                "tls_ca" => c.tls_ca = Some(path(&value)?),
                "tls_cert" => c.tls_cert = Some(path(&value)?),
                "tls_key" => c.tls_key = Some(path(&value)?),
                other => {
                    return Err(PyTypeError::new_err(format!(
                        "got an unexpected keyword argument {other:?} (NATS keywords: {})",
                        NATS_KWARGS.join(", ")
                    )))
                }
            }
        }
        Ok(c)
    }

    /// [`NatsCredentials::options`] as async-nats connect options for the
    /// servers of `nats_url` (`NatsOptions::connect_options`: the `.creds`
    /// file read and parsed, the TLS file checked, credentials written in
    /// the URL taken from it), for a client that connects itself.
    ///
    /// Raises as `options`, and `BadArgument` naming `creds` (unreadable or
    /// malformed file), `tls_ca`, `tls_cert` or `tls_key` (unreadable file)
    /// or `nats_url` (its servers carry different credentials, or it
    /// carries credentials and keywords give some too).
    pub fn connect_options(
        self,
        nats_url: &str,
        name: &str,
        timeout: Duration,
    ) -> PyResult<async_nats::ConnectOptions> {
        self.options(nats_url, name, timeout)?
            .connect_options(nats_url)
            .map_err(options_error)
    }

    /// The options of a connection to `nats_url` named `name`, bounded by
    /// `timeout`. Credentials written in `nats_url` are not put in them
    /// (the connection takes them from the URL: `NatsPlane::connect`), only
    /// checked here, so that a mixed set is refused before connecting.
    ///
    /// Raises `BadArgument` naming `nats_url` (its servers carry different
    /// credentials, or it carries credentials and keywords give some too),
    /// `inbox_prefix` (not a subject prefix),
    /// `password` (a `user` without one),
    /// `user` (a `password` without one), `token` or `creds` (given with
    /// another kind of credentials), `tls_key` (a `tls_cert` without one) or
    /// `tls_cert` (a `tls_key` without one).
    pub fn options(self, nats_url: &str, name: &str, timeout: Duration) -> PyResult<NatsOptions> {
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
        let client_certificate = match (self.tls_cert, self.tls_key) {
            (None, None) => None,
            (Some(cert), Some(key)) => Some((cert, key)),
            (Some(_), None) => return Err(bad_argument("tls_key", "required with `tls_cert`")),
            (None, Some(_)) => return Err(bad_argument("tls_cert", "required with `tls_key`")),
        };
        let options = NatsOptions {
            name: name.to_owned(),
            connect_timeout: timeout,
            auth,
            // Either file turns TLS on by itself (`NatsTls::in_force`).
            tls: NatsTls {
                root_certificates: self.tls_ca,
                client_certificate,
                ..NatsTls::default()
            },
            inbox_prefix: self.inbox_prefix,
            ..NatsOptions::default()
        };
        options
            .clone()
            .with_url_credentials(nats_url)
            .map_err(options_error)?;
        Ok(options)
    }
}

/// A `NatsOptionsError` as `BadArgument` naming the keyword argument behind
/// its field (`nats_url` for the URL's credentials).
fn options_error(e: kv_router_glue::NatsOptionsError) -> PyErr {
    let argument = match e.field {
        "auth" => "creds",
        "tls.root_certificates" => "tls_ca",
        "tls.client_certificate" => "tls_cert",
        "tls.client_key" => "tls_key",
        other => other,
    };
    bad_argument(argument, e.reason)
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
        let o = creds(None, None, None)
            .options("nats://n1", "x", t)
            .unwrap();
        assert!(matches!(o.auth, NatsAuth::None) && !o.tls.in_force());
        let o = creds(Some("u"), Some("p"), None)
            .options("nats://n1", "x", t)
            .unwrap();
        assert!(matches!(o.auth, NatsAuth::UserPassword { ref user, .. } if user == "u"));
        let o = creds(None, None, Some("t"))
            .options("nats://n1", "x", t)
            .unwrap();
        assert!(matches!(o.auth, NatsAuth::Token(ref s) if s == "t"));
        let o = NatsCredentials {
            creds: Some("/d.creds".into()),
            tls_ca: Some("/ca.pem".into()),
            ..NatsCredentials::default()
        }
        .options("nats://n1", "x", t)
        .unwrap();
        assert!(matches!(o.auth, NatsAuth::CredentialsFile(_)) && o.tls.in_force());
        assert_eq!(o.connect_timeout, t);
        let o = NatsCredentials {
            tls_cert: Some("/c.pem".into()),
            tls_key: Some("/c.key".into()),
            ..NatsCredentials::default()
        }
        .options("nats://n1", "x", t)
        .unwrap();
        let pair = o.tls.client_certificate.clone().unwrap();
        assert_eq!(pair, ("/c.pem".into(), "/c.key".into()));
        assert!(o.tls.in_force() && o.tls.root_certificates.is_none());
    }
    // Refusals (BadArgument naming the argument) are tested from Python:
    // tests/test_publisher.py, which needs an interpreter to raise them.
}
