//! Two hosts on one machine: a network namespace joined to the current one
//! by a veth pair, whose link can be cut and restored (iproute2 `ip`).
//!
//! The fault matrix uses it to put a donor in "another host", reachable only
//! over TCP through the veth pair, and to cut the link in the middle of a
//! fetch. Creating namespaces needs `CAP_SYS_ADMIN` and `CAP_NET_ADMIN`
//! (root in the development container and in CI); [`NetnsLink::create`]
//! says why it cannot run instead of half-creating anything.
//!
//! Invariant: everything created is removed on drop (deleting the namespace
//! deletes its end of the veth pair, which deletes the pair), also when
//! creation fails half way; the per-process [`NetnsLink::shared`] link is
//! removed at process exit, and namespaces left by processes that died
//! without exiting are removed by the next [`NetnsLink::create`].
//!
//! UCX (1.23, inside NIXL 1.5.1) reads the routing table once per process
//! and afterwards finds no route through a veth pair created later ("no
//! route to ..."). NIXL users therefore take the one [`NetnsLink::shared`]
//! link of their process, created before their first NIXL agent.

use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

/// Namespace names are `kvq-<pid>-<n>`, so a stale one names its owner.
const NS_PREFIX: &str = "kvq-";

/// Why a namespace pair could not be made.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NetnsError {
    /// `ip` is missing or not permitted here (no root / no capabilities):
    /// the caller skips, printing this.
    #[error("network namespaces unavailable: {0}")]
    Unavailable(String),
    /// An `ip` command failed after the namespace existed.
    #[error("`ip {args}` failed: {reason}")]
    Command {
        /// The arguments, space-joined.
        args: String,
        /// Exit status and stderr.
        reason: String,
    },
}

/// A namespace plus a veth pair: `host_dev` (address `host_ip`) stays in
/// the current namespace, `ns_dev` (address `ns_ip`) lives in `ns`; both
/// in one /30 that no other link of this process uses.
///
/// ```no_run
/// use kv_testkit::netns::NetnsLink;
/// let link = NetnsLink::create()?;
/// // Run a peer inside: `ip netns exec <ns> <program>`.
/// let mut peer = link.command_in_ns("sleep");
/// peer.arg("1");
/// link.cut()?; // the peer becomes unreachable; sockets stay open
/// link.restore()?;
/// # Ok::<(), kv_testkit::netns::NetnsError>(())
/// ```
#[derive(Debug)]
pub struct NetnsLink {
    /// Namespace name (`ip netns` list entry).
    pub ns: String,
    /// veth end in the current namespace.
    pub host_dev: String,
    /// veth end inside `ns`.
    pub ns_dev: String,
    /// Address of `host_dev`.
    pub host_ip: String,
    /// Address of `ns_dev`.
    pub ns_ip: String,
}

fn ip(args: &[&str]) -> Result<(), NetnsError> {
    let out = Command::new("ip")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| NetnsError::Unavailable(format!("cannot run `ip`: {e}")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetnsError::Command {
            args: args.join(" "),
            reason: format!(
                "{}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            ),
        })
    }
}

impl NetnsLink {
    /// Creates a fresh namespace and veth pair, both ends up, with
    /// addresses. Loopback inside the namespace is up too: a NIXL agent
    /// connects to itself through its own address at start, and packets to
    /// a local address travel over `lo`. The only way in or out is the pair.
    ///
    /// # Errors
    /// [`NetnsError::Unavailable`] when the namespace cannot be created at
    /// all (no `ip`, not permitted); [`NetnsError::Command`] when a later
    /// step fails (everything made so far is removed first).
    pub fn create() -> Result<Self, NetnsError> {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let pid = std::process::id();
        let k = NEXT.fetch_add(1, Ordering::Relaxed);
        let (host_dev, ns_dev) = veth_names(pid, k);
        // A /30 per (process, link) inside 10.128.0.0/9, so concurrent test
        // processes do not route into each other's links.
        let net =
            0x0a80_0000u32 | ((pid.wrapping_mul(2654435761) ^ k.wrapping_mul(40503)) & 0x7f_fffc);
        let addr = |host: u32| {
            let a = net | host;
            format!(
                "{}.{}.{}.{}",
                a >> 24,
                (a >> 16) & 0xff,
                (a >> 8) & 0xff,
                a & 0xff
            )
        };
        remove_stale_namespaces();
        let ns = format!("{NS_PREFIX}{pid}-{k}");
        match ip(&["netns", "add", &ns]) {
            Ok(()) => {}
            Err(e @ NetnsError::Unavailable(_)) => return Err(e),
            Err(e) => return Err(NetnsError::Unavailable(e.to_string())),
        }
        let link = Self {
            ns,
            host_dev,
            ns_dev,
            host_ip: addr(1),
            ns_ip: addr(2),
        };
        // `link` is dropped (namespace deleted) if any step fails.
        link.setup()?;
        Ok(link)
    }

    fn setup(&self) -> Result<(), NetnsError> {
        let (h, n, ns) = (&self.host_dev, &self.ns_dev, &self.ns);
        ip(&["link", "add", h, "type", "veth", "peer", "name", n])?;
        ip(&["link", "set", n, "netns", ns])?;
        ip(&["addr", "add", &format!("{}/30", self.host_ip), "dev", h])?;
        ip(&["link", "set", h, "up"])?;
        let in_ns = |args: &[&str]| {
            let mut full = vec!["netns", "exec", ns, "ip"];
            full.extend_from_slice(args);
            ip(&full)
        };
        in_ns(&["addr", "add", &format!("{}/30", self.ns_ip), "dev", n])?;
        in_ns(&["link", "set", n, "up"])?;
        in_ns(&["link", "set", "lo", "up"])?;
        self.wait_host_end_up()
    }

    /// Waits (up to 5 s) until the host end is operationally up: a veth end
    /// gets carrier a moment after both ends were set up, and until then the
    /// kernel has no route through it (UCX then fails with "no route").
    fn wait_host_end_up(&self) -> Result<(), NetnsError> {
        let path = format!("/sys/class/net/{}/operstate", self.host_dev);
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let state = std::fs::read_to_string(&path).unwrap_or_default();
            if state.trim() == "up" {
                return Ok(());
            }
            if std::time::Instant::now() >= end {
                return Err(NetnsError::Command {
                    args: format!("link show {}", self.host_dev),
                    reason: format!("operstate {:?} after 5 s", state.trim()),
                });
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// This process's link, created on first use and removed at exit (see
    /// the module docs for why NIXL users share one). A creation failure is
    /// remembered: later calls return the same error.
    ///
    /// # Errors
    /// As [`NetnsLink::create`].
    pub fn shared() -> Result<&'static NetnsLink, NetnsError> {
        static SHARED: OnceLock<Result<NetnsLink, NetnsError>> = OnceLock::new();
        extern "C" fn remove_shared() {
            if let Some(Ok(link)) = SHARED.get() {
                link.remove();
            }
        }
        SHARED
            .get_or_init(|| {
                let link = NetnsLink::create()?;
                // SAFETY: `remove_shared` is a plain `extern "C" fn()` that
                // only reads a static and runs `ip`; registering it has no
                // other effect. If registration fails the link is left to
                // the next process's stale-namespace sweep.
                unsafe {
                    libc::atexit(remove_shared);
                }
                Ok(link)
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// A command that runs `program` inside the namespace
    /// (`ip netns exec <ns> <program>`); add arguments and environment.
    pub fn command_in_ns(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns]).arg(program);
        c
    }

    /// Cuts the link: the host end goes down. Established TCP connections
    /// are not reset; their packets are dropped until [`NetnsLink::restore`].
    ///
    /// # Errors
    /// [`NetnsError::Command`] when `ip link set down` fails.
    pub fn cut(&self) -> Result<(), NetnsError> {
        ip(&["link", "set", &self.host_dev, "down"])
    }

    /// Brings the host end up again (its address is kept while down) and
    /// waits until it carries packets.
    ///
    /// # Errors
    /// [`NetnsError::Command`] when `ip link set up` fails or the end is not
    /// up within 5 s.
    pub fn restore(&self) -> Result<(), NetnsError> {
        ip(&["link", "set", &self.host_dev, "up"])?;
        self.wait_host_end_up()
    }
}

impl NetnsLink {
    fn remove(&self) {
        // Deleting the namespace destroys `ns_dev`, and with it the pair; the
        // explicit `link del` covers a pair whose peer never moved into it.
        let _ = ip(&["netns", "del", &self.ns]);
        let _ = ip(&["link", "del", &self.host_dev]);
    }
}

impl Drop for NetnsLink {
    fn drop(&mut self) {
        self.remove();
    }
}

/// The veth pair's names for link `k` of process `pid`: (host end, namespace
/// end). Interface names are at most 15 bytes: "kv" + 5 hex + counter + side.
fn veth_names(pid: u32, k: u32) -> (String, String) {
    let tag = format!("{:05x}{}", pid & 0xfffff, k % 1000);
    (format!("kv{tag}h"), format!("kv{tag}n"))
}

/// Deletes `kvq-<pid>-<n>` namespaces whose process no longer exists, and
/// the host end of their veth pair (a pair whose namespace end was already
/// gone would otherwise stay).
fn remove_stale_namespaces() {
    let Ok(out) = Command::new("ip").args(["netns", "list"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(name) = line.split_whitespace().next() else {
            continue;
        };
        let owner = name.strip_prefix(NS_PREFIX).and_then(|rest| {
            let (pid, k) = rest.split_once('-')?;
            Some((pid.parse::<u32>().ok()?, k.parse::<u32>().ok()?))
        });
        if let Some((pid, k)) = owner {
            if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                let _ = ip(&["netns", "del", name]);
                let _ = ip(&["link", "del", &veth_names(pid, k).0]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether a TCP connection from inside the namespace to `port` on the
    /// host end succeeds within 1 s (bash's `/dev/tcp`, no extra tools).
    fn connects(link: &NetnsLink, port: u16) -> bool {
        link.command_in_ns("timeout")
            .args([
                "1",
                "bash",
                "-c",
                &format!("exec 3<>/dev/tcp/{}/{port}", link.host_ip),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    #[test]
    fn a_link_carries_tcp_until_cut_and_disappears_on_drop() {
        let link = match NetnsLink::create() {
            Ok(l) => l,
            Err(NetnsError::Unavailable(why)) => {
                println!("SKIP netns test: {why}");
                return;
            }
            Err(e) => panic!("{e}"),
        };
        let listener = std::net::TcpListener::bind((link.host_ip.as_str(), 0)).unwrap();
        let port = listener.local_addr().unwrap().port();
        assert!(connects(&link, port), "ns -> host over the veth pair");
        link.cut().unwrap();
        assert!(!connects(&link, port), "the cut link must drop packets");
        link.restore().unwrap();
        assert!(
            (0..20).any(|_| connects(&link, port)),
            "restored link carries packets again"
        );
        let (ns, dev) = (link.ns.clone(), link.host_dev.clone());
        drop(link);
        let list = Command::new("ip").args(["netns", "list"]).output().unwrap();
        assert!(!String::from_utf8_lossy(&list.stdout).contains(&ns));
        assert!(
            ip(&["link", "show", &dev]).is_err(),
            "veth {dev} left behind"
        );
    }
}
