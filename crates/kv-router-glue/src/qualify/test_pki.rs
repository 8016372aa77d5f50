//! A throwaway PKI for TLS tests: a CA and the certificates it signs, made
//! with the `openssl` command in a temporary directory of the test's own
//! (removed on drop). Harness code for tests of the NATS plane, the router
//! binary and the wheel over TLS; nothing in the roles uses it.
//!
//! Certificates are RSA-2048, valid for one day; the server certificate is
//! for `IP:127.0.0.1` (the loopback `nats-server` of
//! [`super::nats_server::NatsServer`]). Without `openssl`,
//! [`TestPki::new_or_skip`] skips with a printed reason, and fails under
//! `CI=true` ([`kv_transfer::ci_requires`]).

use super::nats_server::NatsServer;
use crate::NatsTls;

/// A throwaway PKI made with `openssl` in its own temporary directory
/// (removed on drop): CAs, and certificates they sign (module docs).
///
/// ```no_run
/// use kv_router_glue::test_pki::TestPki;
///
/// // CA "ca" and a server certificate for 127.0.0.1, or a printed SKIP.
/// let Some(pki) = TestPki::new_or_skip("my_tls_test") else { return };
/// let (cert, key) = pki.issue_client("ca", "router");
/// // A TLS nats-server that verifies client certificates of "ca".
/// let server = pki.start_server(&["--tlsverify", "--tlscacert", &pki.arg("ca.pem")]);
/// let tls = pki.client_tls(Some((cert, key)));
/// assert!(tls.in_force());
/// # drop(server);
/// ```
pub struct TestPki {
    dir: std::path::PathBuf,
}

impl TestPki {
    /// A CA `ca` and a certificate `server` it signs for 127.0.0.1, in a
    /// directory of `test`'s own; `None` after a printed `SKIP` line when
    /// `openssl` cannot make them, a panic under `CI=true`.
    pub fn new_or_skip(test: &str) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("kv-{test}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pki = Self { dir };
        let made = pki
            .make_ca("ca")
            .and_then(|()| pki.issue("ca", "server", "127.0.0.1", "subjectAltName=IP:127.0.0.1"));
        match made {
            Ok(()) => Some(pki),
            Err(e) if kv_transfer::ci_requires() => {
                panic!("{test}: CI=true and openssl could not make test certificates: {e}")
            }
            Err(e) => {
                println!("SKIP {test}: openssl could not make test certificates ({e})");
                None
            }
        }
    }

    /// The path of file `name` in the PKI directory.
    pub fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.join(name)
    }

    /// [`TestPki::path`] as an argument string.
    pub fn arg(&self, name: &str) -> String {
        self.path(name).to_string_lossy().into_owned()
    }

    fn openssl(args: &[&str]) -> Result<(), String> {
        let out = std::process::Command::new("openssl")
            .args(args)
            .output()
            .map_err(|e| format!("cannot run openssl: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            Err(format!(
                "openssl {} failed with {}: {}",
                args[0],
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        }
    }

    /// A self-signed CA: `<ca>.pem` and `<ca>.key`.
    pub fn make_ca(&self, ca: &str) -> Result<(), String> {
        Self::openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            &format!("/CN=kv-test-{ca}"),
            "-keyout",
            &self.arg(&format!("{ca}.key")),
            "-out",
            &self.arg(&format!("{ca}.pem")),
        ])
    }

    /// A certificate for `cn` with the X.509v3 extensions `ext` (one
    /// `openssl x509 -extfile` line), signed by CA `ca`: `<name>.pem` and
    /// `<name>.key`.
    pub fn issue(&self, ca: &str, name: &str, cn: &str, ext: &str) -> Result<(), String> {
        let ext_file = self.path(&format!("{name}.ext"));
        std::fs::write(&ext_file, format!("{ext}\n")).map_err(|e| e.to_string())?;
        Self::openssl(&[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-subj",
            &format!("/CN={cn}"),
            "-keyout",
            &self.arg(&format!("{name}.key")),
            "-out",
            &self.arg(&format!("{name}.csr")),
        ])?;
        Self::openssl(&[
            "x509",
            "-req",
            "-in",
            &self.arg(&format!("{name}.csr")),
            "-CA",
            &self.arg(&format!("{ca}.pem")),
            "-CAkey",
            &self.arg(&format!("{ca}.key")),
            "-CAcreateserial",
            "-days",
            "1",
            "-extfile",
            &ext_file.to_string_lossy(),
            "-out",
            &self.arg(&format!("{name}.pem")),
        ])
    }

    /// A client certificate `<name>.pem` (CN `name`, `clientAuth`) and its
    /// key `<name>.key`, signed by CA `ca`, as `NatsTls` takes them.
    ///
    /// # Panics
    /// When `openssl` fails (after [`TestPki::new_or_skip`] succeeded).
    pub fn issue_client(&self, ca: &str, name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        self.issue(ca, name, name, "extendedKeyUsage=clientAuth")
            .unwrap_or_else(|e| panic!("client certificate {name}: {e}"));
        (
            self.path(&format!("{name}.pem")),
            self.path(&format!("{name}.key")),
        )
    }

    /// A `nats-server` with TLS on the `server` certificate, plus `extra`
    /// arguments (`--tlsverify --tlscacert <ca.pem>` to verify clients).
    ///
    /// # Panics
    /// When the server does not start (a harness failure, not a skip).
    pub fn start_server(&self, extra: &[&str]) -> NatsServer {
        let (cert, key) = (self.arg("server.pem"), self.arg("server.key"));
        let mut args = vec!["--tls", "--tlscert", &cert, "--tlskey", &key];
        args.extend_from_slice(extra);
        NatsServer::start_with_args(&args).unwrap()
    }

    /// TLS required, the server verified against CA `ca`, and an optional
    /// client certificate.
    pub fn client_tls(&self, client: Option<(std::path::PathBuf, std::path::PathBuf)>) -> NatsTls {
        NatsTls {
            require: true,
            root_certificates: Some(self.path("ca.pem")),
            client_certificate: client,
        }
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
