//! Binding a [`PinService`] endpoint: a Unix socket made
//! [`UNIX_SOCKET_MODE`], or a TCP port (only with a key).

use std::fs::FileType;
use std::net::TcpListener;
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::UnixListener;

use crate::pin_transport::{tcp_wake_addr, PinEndpoint};

use super::*;

/// What [`listen()`] bound: the listener, the endpoint to publish, the socket
/// file to remove at shutdown (Unix), and where shutdown wakes the accept
/// thread from.
pub(super) type Bound = (PinListener, String, Option<PathBuf>, WakeAddr);

/// Binds `endpoint`; a `tcp:` one only when `has_key` (the service then
/// authenticates every connection). Port 0 binds a free port, and the
/// published endpoint names it.
pub(super) fn listen(endpoint: &str, has_key: bool) -> Result<Bound, PinServiceError> {
    match PinEndpoint::parse(endpoint)? {
        PinEndpoint::Unix(path) => {
            let (l, w) = bind_unix(endpoint, &path)?;
            Ok((l, endpoint.to_owned(), Some(path), w))
        }
        PinEndpoint::Tcp(addr) => {
            if !has_key {
                return Err(PinServiceError::AuthRequired {
                    endpoint: endpoint.to_owned(),
                });
            }
            let sock_err = |op, source| PinServiceError::Socket {
                path: PathBuf::from(&addr),
                op,
                source,
            };
            let l = TcpListener::bind(&addr).map_err(|e| sock_err("bind", e))?;
            let local = l.local_addr().map_err(|e| sock_err("local_addr", e))?;
            let w = WakeAddr::Tcp(tcp_wake_addr(local));
            Ok((PinListener::Tcp(l), format!("tcp:{local}"), None, w))
        }
    }
}

/// Binds a Unix socket at `path` with mode [`UNIX_SOCKET_MODE`].
///
/// `bind` creates the file with the process umask; the mode is set right
/// after, and any connection that arrived in between (when another user
/// could still connect) is accepted and closed unserved before the accept
/// thread starts, so every served connection passed the 0600 check.
fn bind_unix(endpoint: &str, path: &PathBuf) -> Result<(PinListener, WakeAddr), PinServiceError> {
    let sock_err = |op, source| PinServiceError::Socket {
        path: path.clone(),
        op,
        source,
    };
    // `symlink_metadata`, not `exists()`: the path itself is checked, so a
    // symlink is never followed to (and its target never removed).
    match std::fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(sock_err("stat", e)),
        Ok(meta) if meta.file_type().is_socket() => {
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                return Err(PinServiceError::InUse {
                    endpoint: endpoint.to_owned(),
                });
            }
            // Nobody accepts on it: a crashed donor's socket, safe to replace.
            std::fs::remove_file(path).map_err(|e| sock_err("remove stale socket", e))?;
        }
        // Anything else is someone's data (a mistyped endpoint naming a
        // config file, say): never removed, only refused.
        Ok(meta) => {
            return Err(PinServiceError::NotASocket {
                endpoint: endpoint.to_owned(),
                path: path.clone(),
                found: file_kind(meta.file_type()),
            });
        }
    }
    let listener = UnixListener::bind(path).map_err(|e| sock_err("bind", e))?;
    let chmod = std::fs::set_permissions(path, std::fs::Permissions::from_mode(UNIX_SOCKET_MODE))
        .and_then(|()| listener.set_nonblocking(true))
        .and_then(|()| {
            while listener.accept().is_ok() {}
            listener.set_nonblocking(false)
        });
    if let Err(e) = chmod {
        let _ = std::fs::remove_file(path);
        return Err(sock_err("chmod 0600", e));
    }
    Ok((PinListener::Unix(listener), WakeAddr::Unix(path.clone())))
}

/// What a non-socket file at a socket path is, for
/// [`PinServiceError::NotASocket`].
fn file_kind(t: FileType) -> &'static str {
    if t.is_file() {
        "regular file"
    } else if t.is_dir() {
        "directory"
    } else if t.is_symlink() {
        "symbolic link"
    } else if t.is_fifo() {
        "FIFO"
    } else if t.is_block_device() || t.is_char_device() {
        "device file"
    } else {
        "file that is not a socket"
    }
}
