//! Which UCX transport moved a NIXL part's bytes, and whether the GPU path
//! may accept it.
//!
//! NIXL 1.5.1's C API does not say which UCX transport (cuda_ipc, cma, tcp,
//! ...) moved the bytes. UCX prints its protocol selection when started with
//! `UCX_PROTO_INFO=y`; when, in addition, `UCX_LOG_FILE` names a file (`%p` =
//! pid is expanded), each part reads the last `ucp_get` selection for its
//! memory types from that file (e.g. `cma/memory`, `cuda_ipc/cuda`,
//! `tcp/lo`). Otherwise, or when the file has no matching table, the
//! transport is unknown. `nixl_two_process::enable_ucx_proto_log` (harness)
//! turns the log on for a process (before its first agent).
//!
//! The GPU path (a device destination) fails closed ([`gpu_path_verdict`]):
//! it accepts a part only when every protocol row UCX selected is a
//! zero-copy read over a device-direct transport (`cuda_ipc`, or
//! GPUDirect RDMA over `rc` / `dc`). A known host-staged transport (`tcp`,
//! shared memory, `cma`, `self`, software emulation, pipelines through
//! bounce buffers) counts its bytes as host payload, which
//! [`crate::deliver`] refuses as [`TransferError::HostStaged`]; anything
//! else, an unknown transport included, is
//! [`TransferError::TransportUnverified`]. Restricting UCX's transports
//! instead was measured not to work with the NIXL wheel: any `UCX_TLS`
//! without `tcp` makes NIXL fail to create its UCX backend ("Destination is
//! unreachable"), and with `tcp` allowed UCX may pick it for device memory
//! (`software emulation | tcp/lo` between two agents of one process).

use kv_bank::MemoryKind;

use crate::TransferError;

/// One row of a UCX protocol-selection table: the protocol's description
/// (`zero-copy`, `software emulation`, `copy-in`, ...) and its config
/// column (`transport/device`, e.g. `cuda_ipc/cuda`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxProtoRow {
    /// Description column, as UCX prints it.
    pub description: String,
    /// Config column: transport and device, e.g. `tcp/lo`.
    pub config: String,
}

/// What the GPU path decides about one part's transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuPathVerdict {
    /// Every row is a zero-copy read over a device-direct transport: no
    /// payload byte passed through host memory.
    DeviceDirect,
    /// A row stages payload through host memory: count it as host payload.
    HostStaged,
    /// The transport cannot be established (no protocol log, or a
    /// transport this crate does not classify): refuse, naming why.
    Unverified(String),
}

/// Transports that read device memory without a host copy, when UCX
/// selected them for a zero-copy protocol: CUDA IPC (same host), and
/// GPUDirect RDMA over InfiniBand / RoCE (`rc_mlx5`, `rc_verbs`, `dc_mlx5`:
/// UCX picks their zero-copy get for device memory only when the NIC can
/// register it).
const DEVICE_DIRECT: [&str; 3] = ["cuda_ipc", "rc", "dc"];

/// Transports that move device memory through host buffers (`tcp`, shared
/// memory `sysv` / `posix` / `cma` / `knem` / `xpmem`, `self`).
const HOST_STAGED: [&str; 7] = ["tcp", "sysv", "posix", "cma", "knem", "xpmem", "self"];

/// Descriptions of protocols that copy payload through host buffers.
const HOST_STAGED_PROTOCOLS: [&str; 5] = ["emulation", "copy-in", "copy-out", "pipeline", "bcopy"];

fn transport_name(config: &str) -> &str {
    config.split('/').next().unwrap_or(config).trim()
}

fn is_host_staged(row: &UcxProtoRow) -> bool {
    let t = transport_name(&row.config);
    HOST_STAGED.iter().any(|h| t.starts_with(h))
        || HOST_STAGED_PROTOCOLS
            .iter()
            .any(|p| row.description.contains(p))
}

fn is_device_direct(row: &UcxProtoRow) -> bool {
    let t = transport_name(&row.config);
    row.description.contains("zero-copy")
        && DEVICE_DIRECT
            .iter()
            .any(|d| t == *d || t.starts_with(&format!("{d}_")))
}

/// The GPU path's decision for a part whose protocol rows are `rows`
/// (`None`: the transport is unknown). Pure: the caller reads the rows
/// ([`ucx_get_rows`]) and acts on the verdict.
///
/// ```
/// use kv_transfer::nixl_transport::{gpu_path_verdict, GpuPathVerdict, UcxProtoRow};
/// let row = |d: &str, c: &str| UcxProtoRow { description: d.into(), config: c.into() };
/// assert!(matches!(gpu_path_verdict(None), GpuPathVerdict::Unverified(_)));
/// assert_eq!(
///     gpu_path_verdict(Some(&[row("zero-copy", "cuda_ipc/cuda")])),
///     GpuPathVerdict::DeviceDirect
/// );
/// assert_eq!(
///     gpu_path_verdict(Some(&[row("software emulation", "tcp/lo")])),
///     GpuPathVerdict::HostStaged
/// );
/// ```
pub fn gpu_path_verdict(rows: Option<&[UcxProtoRow]>) -> GpuPathVerdict {
    let Some(rows) = rows.filter(|r| !r.is_empty()) else {
        return GpuPathVerdict::Unverified(
            "UCX did not report the transport (start the process with UCX_PROTO_INFO=y and \
             UCX_LOG_FILE set, e.g. nixl_two_process::enable_ucx_proto_log)"
                .into(),
        );
    };
    if rows.iter().any(is_host_staged) {
        return GpuPathVerdict::HostStaged;
    }
    match rows.iter().find(|r| !is_device_direct(r)) {
        None => GpuPathVerdict::DeviceDirect,
        Some(r) => GpuPathVerdict::Unverified(format!(
            "`{}` over `{}` is not a known device-direct zero-copy transport",
            r.description, r.config
        )),
    }
}

/// Host payload bytes of a NIXL part that moved `bytes` from `src` memory
/// into `dst` memory over `rows`, or the refusal of the GPU path.
///
/// A host destination or source means the payload is in host memory by
/// design (`bytes`; [`crate::deliver`] refuses it toward a device). Toward
/// a device from a device: 0 only for [`GpuPathVerdict::DeviceDirect`],
/// `bytes` for [`GpuPathVerdict::HostStaged`].
///
/// # Errors
/// [`TransferError::TransportUnverified`] naming `rank` and the transport
/// when a device-to-device part's transport is unknown or unclassified.
pub fn part_host_payload(
    rank: u32,
    dst: MemoryKind,
    src: MemoryKind,
    rows: Option<&[UcxProtoRow]>,
    bytes: u64,
) -> Result<u64, TransferError> {
    if dst == MemoryKind::Host || src == MemoryKind::Host {
        return Ok(bytes);
    }
    match gpu_path_verdict(rows) {
        GpuPathVerdict::DeviceDirect => Ok(0),
        GpuPathVerdict::HostStaged => Ok(bytes),
        GpuPathVerdict::Unverified(reason) => Err(TransferError::TransportUnverified {
            rank,
            transport: transport_label(rows),
            reason,
        }),
    }
}

/// The transport label of `rows`: distinct config columns joined with `,`,
/// or `unknown`.
pub fn transport_label(rows: Option<&[UcxProtoRow]>) -> String {
    let mut seen: Vec<&str> = Vec::new();
    for r in rows.unwrap_or_default() {
        if !seen.contains(&r.config.as_str()) {
            seen.push(&r.config);
        }
    }
    if seen.is_empty() {
        "unknown".into()
    } else {
        seen.join(",")
    }
}

/// The UCX log file holding protocol-selection tables, when the environment
/// asked UCX to write them (`UCX_PROTO_INFO=y` and `UCX_LOG_FILE`).
fn ucx_proto_log() -> Option<std::path::PathBuf> {
    if !std::env::var("UCX_PROTO_INFO")
        .ok()?
        .eq_ignore_ascii_case("y")
    {
        return None;
    }
    let f = std::env::var("UCX_LOG_FILE").ok()?;
    let f = f.replace("%p", &std::process::id().to_string());
    (!f.contains('%')).then(|| f.into())
}

/// UCX's memory-type names in its protocol tables.
fn ucx_mem_name(kind: MemoryKind) -> &'static str {
    match kind {
        MemoryKind::Host => "host",
        MemoryKind::Cuda { .. } => "cuda",
    }
}

/// The rows of the last `ucp_get` table reading `src` memory into `dst`
/// memory (UCX names: `host`, `cuda`) in a UCX `UCX_PROTO_INFO` log.
///
/// Table shape (UCX 1.19):
/// ```text
/// | remote memory read by ucp_get*(multi) into host memory from host |
/// (device memory: `... into cuda/GPU0 from cuda |`)
/// +--------+-------------+-------------------------------------------+
/// | Range  | Description |                  Config                   |
/// +--------+-------------+-------------------------------------------+
/// | 0..inf | zero-copy   | cma/memory                                |
/// +--------+-------------+-------------------------------------------+
/// ```
pub fn ucx_get_rows(log: &str, dst: &str, src: &str) -> Option<Vec<UcxProtoRow>> {
    let (into, from) = (format!("into {dst}"), format!("from {src}"));
    let lines: Vec<&str> = log.lines().collect();
    let start = lines.iter().rposition(|l| {
        l.contains("remote memory read by ucp_get") && l.contains(&into) && l.contains(&from)
    })?;
    let mut found: Vec<UcxProtoRow> = Vec::new();
    for l in &lines[start + 1..] {
        let cells: Vec<&str> = l.split('|').map(str::trim).collect();
        // A data row is `| range | description | config |`; stop at the next table.
        if cells.len() >= 4 && cells[1].contains("..") {
            let row = UcxProtoRow {
                description: cells[2].to_string(),
                config: cells[3].to_string(),
            };
            if !row.config.is_empty() && !found.contains(&row) {
                found.push(row);
            }
        } else if (!found.is_empty() && !l.contains("+---"))
            || l.contains("remote memory")
            || l.contains("active message")
        {
            break;
        }
    }
    (!found.is_empty()).then_some(found)
}

/// The rows UCX logged for its last `ucp_get` reading `src` memory into
/// `dst` memory in this process, when the protocol log is enabled (see the
/// module docs); `None` otherwise.
pub(crate) fn ucx_rows(dst: MemoryKind, src: MemoryKind) -> Option<Vec<UcxProtoRow>> {
    let path = ucx_proto_log()?;
    // UCX writes its log through a buffered `FILE*`: the table of the first
    // read may still sit in the buffer (seen with two processes over `cma`).
    // SAFETY: `fflush(NULL)` flushes every open output stream of this
    // process; it takes each stream's lock and touches no Rust memory.
    unsafe { libc::fflush(std::ptr::null_mut()) };
    let log = std::fs::read_to_string(path).ok()?;
    ucx_get_rows(&log, ucx_mem_name(dst), ucx_mem_name(src))
}

/// [`ucx_rows`] as a transport label (`unknown` when not logged).
// Only the two-process harness reports a label without a delivery.
#[cfg(feature = "qualify")]
pub(crate) fn ucx_transport(dst: MemoryKind, src: MemoryKind) -> Option<String> {
    ucx_rows(dst, src).map(|r| transport_label(Some(&r)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
[1] [vm:1:2]   | remote memory read by ucp_get*(multi) into host memory from host |
[1] [vm:1:2]   +--------+-------------+-------------------------------------------+
[1] [vm:1:2]   | Range  | Description |                  Config                   |
[1] [vm:1:2]   +--------+-------------+-------------------------------------------+
[1] [vm:1:2]   | 0..inf | zero-copy   | cma/memory                                |
[1] [vm:1:2]   +--------+-------------+-------------------------------------------+
[2] [vm:1:1]   | active message by ucp_am_send* from host memory |
[2] [vm:1:1]   |          0 | short              | tcp/lo        |
[3] [vm:1:2]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda |
[3] [vm:1:2]   | Range  | Description |                  Config                   |
[3] [vm:1:2]   | 0..inf | software emulation | tcp/lo                           |
[3] [vm:1:2]   +--------+-------------+-------------------------------------------+
";

    fn row(d: &str, c: &str) -> UcxProtoRow {
        UcxProtoRow {
            description: d.into(),
            config: c.into(),
        }
    }

    #[test]
    fn parses_the_get_table_of_the_right_memory_types() {
        assert_eq!(
            ucx_get_rows(LOG, "host", "host"),
            Some(vec![row("zero-copy", "cma/memory")])
        );
        assert_eq!(
            ucx_get_rows(LOG, "cuda", "cuda"),
            Some(vec![row("software emulation", "tcp/lo")])
        );
        assert_eq!(ucx_get_rows(LOG, "host", "cuda"), None);
        assert_eq!(ucx_get_rows("", "host", "host"), None);
        let rows = ucx_get_rows(LOG, "host", "host").unwrap();
        assert_eq!(transport_label(Some(&rows)), "cma/memory");
        assert_eq!(transport_label(None), "unknown");
    }

    #[test]
    fn the_gpu_path_accepts_only_known_device_direct_zero_copy() {
        use GpuPathVerdict::*;
        let v = |rows: &[UcxProtoRow]| gpu_path_verdict(Some(rows));
        assert_eq!(v(&[row("zero-copy", "cuda_ipc/cuda")]), DeviceDirect);
        assert_eq!(v(&[row("zero-copy", "rc_mlx5/mlx5_0:1")]), DeviceDirect);
        assert_eq!(v(&[row("zero-copy", "dc_mlx5/mlx5_0:1")]), DeviceDirect);
        // The issue's one-process run: UCX emulated the read over TCP.
        assert_eq!(v(&[row("software emulation", "tcp/lo")]), HostStaged);
        assert_eq!(v(&[row("zero-copy", "cma/memory")]), HostStaged);
        assert_eq!(
            v(&[
                row("zero-copy", "cuda_ipc/cuda"),
                row("zero-copy", "tcp/lo")
            ]),
            HostStaged,
            "one host-staged row taints the part"
        );
        assert_eq!(v(&[row("copy-in", "rc_mlx5/mlx5_0:1")]), HostStaged);
        assert_eq!(
            v(&[row("rendezvous pipeline", "cuda_copy/cuda")]),
            HostStaged
        );
        // Unknown: no log, an empty table, an unclassified transport.
        assert!(matches!(gpu_path_verdict(None), Unverified(_)));
        assert!(matches!(gpu_path_verdict(Some(&[])), Unverified(_)));
        assert!(matches!(
            v(&[row("zero-copy", "gdr_copy/cuda")]),
            Unverified(_)
        ));
        assert!(matches!(v(&[row("zero-copy", "rcx/x")]), Unverified(_)));
    }

    #[test]
    fn device_to_device_parts_without_evidence_fail_closed() {
        let cuda = MemoryKind::Cuda { ordinal: 0 };
        let e = part_host_payload(1, cuda, cuda, None, 4096).unwrap_err();
        match &e {
            TransferError::TransportUnverified {
                rank: 1, transport, ..
            } => assert_eq!(transport, "unknown"),
            other => panic!("unexpected {other}"),
        }
        assert!(
            !e.may_still_write(),
            "the read finished; rows may be reused"
        );
        let tcp = [row("software emulation", "tcp/lo")];
        assert_eq!(
            part_host_payload(0, cuda, cuda, Some(&tcp), 4096).unwrap(),
            4096
        );
        let ipc = [row("zero-copy", "cuda_ipc/cuda")];
        assert_eq!(
            part_host_payload(0, cuda, cuda, Some(&ipc), 4096).unwrap(),
            0
        );
        // Host memory on either side is host payload by design, logged or not.
        for (d, s) in [(MemoryKind::Host, cuda), (cuda, MemoryKind::Host)] {
            assert_eq!(part_host_payload(0, d, s, None, 4096).unwrap(), 4096);
        }
        assert_eq!(
            part_host_payload(0, MemoryKind::Host, MemoryKind::Host, None, 7).unwrap(),
            7
        );
    }
}
