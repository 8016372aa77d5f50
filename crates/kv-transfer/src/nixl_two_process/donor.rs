//! The donor process of the two-process NIXL benchmark: its argument
//! words, the child role ([`donor_main`]) and the target's handle on the
//! running child ([`DonorProcess`]: handshake, stderr, shutdown).

use super::*;
use kv_bank::child_process::{ChildProcess, ChildStderr, ChildStdin};

/// Donor arguments: `<dram|vram> <gpu> <bytes> <timeout_s>`.
pub(super) fn donor_args(opts: &TwoProcessOpts) -> Vec<String> {
    vec![
        opts.memory.word().into(),
        opts.donor_gpu.to_string(),
        opts.donor_bytes().to_string(),
        opts.donor_timeout.as_secs().max(1).to_string(),
    ]
}

pub(super) struct DonorArgs {
    pub(super) memory: Memory,
    pub(super) gpu: u32,
    pub(super) bytes: usize,
    pub(super) timeout: Duration,
}

pub(super) fn parse_donor_args(args: &[String]) -> Result<DonorArgs, TransferError> {
    let [memory, gpu, bytes, timeout] = args else {
        return Err(TransferError::input(
            "args",
            "expected <dram|vram> <gpu> <bytes> <timeout_s>",
        ));
    };
    let memory = match memory.as_str() {
        "dram" => Memory::Dram,
        "vram" => Memory::Vram,
        other => {
            return Err(TransferError::input(
                "memory",
                format!("{other:?}: not dram|vram"),
            ))
        }
    };
    let num = |what: &'static str, s: &str| {
        s.parse::<u64>()
            .map_err(|_| TransferError::input(what, format!("{s:?}: not a number")))
    };
    let bytes = num("bytes", bytes)? as usize;
    if bytes == 0 {
        return Err(TransferError::input("bytes", "must be positive"));
    }
    Ok(DonorArgs {
        memory,
        gpu: num("gpu", gpu)? as u32,
        bytes,
        timeout: Duration::from_secs(num("timeout_s", timeout)?),
    })
}

/// Donor side. Prints one [`DonorHandshake`] JSON line on stdout, then waits
/// until stdin reaches EOF (the target closes it) or `timeout_s` passes.
/// Returns the exit code: 0 after EOF, [`DONOR_TIMEOUT_EXIT`] on timeout, 2
/// on a bad argument or a setup failure (reason on stderr).
pub fn donor_main(args: &[String]) -> i32 {
    match donor(args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("{DONOR_ROLE}: {e}");
            2
        }
    }
}

fn donor(args: &[String]) -> Result<i32, TransferError> {
    let a = parse_donor_args(args)?;
    // Declared before the agent so the agent (and its registration) goes first.
    let (region, ipc): (Box<dyn BankMemory>, Option<CudaDeviceMemory>) = match a.memory {
        Memory::Dram => (Box::new(HostBuffer::zeroed(a.bytes)?), None),
        Memory::Vram => {
            if !crate::cuda::driver_present() {
                return Err(TransferError::Cuda {
                    op: "libcuda",
                    reason: "CUDA driver library not found in the donor".into(),
                });
            }
            (
                Box::new(CudaDeviceMemory::new(a.gpu, a.bytes)?),
                Some(CudaDeviceMemory::new(a.gpu, a.bytes)?),
            )
        }
    };
    fill_pattern(region.as_ref())?;
    if let Some(m) = &ipc {
        fill_pattern(m)?;
    }
    let agent = NixlAgent::new(&format!("kvx-2p-donor-{}", std::process::id()))?;
    agent.register(region.as_ref())?;
    let hs = DonorHandshake {
        pid: std::process::id(),
        memory: a.memory,
        gpu: a.gpu,
        metadata_hex: hex(&agent.metadata()?),
        base_addr: region.base_addr(),
        len: region.len() as u64,
        ipc_handle_hex: ipc.as_ref().map(|m| hex(m.handle_bytes())),
        ipc_len: ipc.as_ref().map_or(0, |m| m.len() as u64),
    };
    let line = serde_json::to_string(&hs).map_err(|e| TransferError::Host(e.to_string()))?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")
            .and_then(|()| out.flush())
            .map_err(|e| TransferError::Host(format!("writing the handshake: {e}")))?;
    }
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut sink = Vec::new();
        let _ = std::io::stdin().lock().read_to_end(&mut sink);
        let _ = tx.send(());
    });
    let code = match rx.recv_timeout(a.timeout) {
        Ok(()) | Err(mpsc::RecvTimeoutError::Disconnected) => 0,
        Err(mpsc::RecvTimeoutError::Timeout) => {
            eprintln!(
                "{DONOR_ROLE}: stdin still open after {} s; exiting",
                a.timeout.as_secs()
            );
            DONOR_TIMEOUT_EXIT
        }
    };
    drop(agent);
    drop(region);
    drop(ipc);
    Ok(code)
}

/// The running donor: closes its stdin on drop, waits a little, then kills
/// it. Started through the workspace's one child-process harness
/// ([`kv_bank::child_process`]): stdin is its lifeline, stderr captured.
pub(super) struct DonorProcess {
    child: ChildProcess,
    exit: Option<String>,
}

impl DonorProcess {
    pub(super) fn spawn(cmd: Command) -> Result<Self, TransferError> {
        let child = ChildProcess::spawn_with(cmd, ChildStdin::Lifeline, ChildStderr::Capture)
            .map_err(|e| TransferError::Host(format!("spawning the donor: {e}")))?;
        Ok(Self { child, exit: None })
    }

    pub(super) fn handshake(&mut self, timeout: Duration) -> Result<DonorHandshake, TransferError> {
        self.child.next_json("handshake", timeout).map_err(|e| {
            // Give the stderr reader a moment to drain.
            std::thread::sleep(Duration::from_millis(100));
            TransferError::Host(format!("donor: {e}; stderr: {}", self.child.stderr_tail()))
        })
    }

    /// Closes stdin, waits up to 10 s, kills; returns how it ended.
    pub(super) fn finish(&mut self) -> String {
        if let Some(e) = &self.exit {
            return e.clone();
        }
        self.child.close_lifeline();
        let how = match self.child.wait_exit(Duration::from_secs(10)) {
            Some(st) => st.to_string(),
            None => "killed after 10 s without exiting".to_string(),
        };
        self.exit = Some(how.clone());
        how
    }
}

impl Drop for DonorProcess {
    fn drop(&mut self) {
        self.finish();
    }
}
