//! A host segment or bank that does not fit in `/dev/shm` is refused when it
//! is created, with a typed error naming the field, and leaves nothing
//! behind. Unreserved, tmpfs accepts it (pages come on first touch) and the
//! first write past the free space kills the process with `SIGBUS`.
//!
//! The requests are larger than the whole filesystem, so tmpfs refuses the
//! reservation before allocating a page: nothing on the host is filled, even
//! for a moment. A `/dev/shm` mounted without a size limit reports no size;
//! there no request is refused up front and these tests only say so.

use std::path::Path;

use kv_bank::{BankConfig, BankError, BankManager, HostShmMemory, SHM_DIR};
use kv_descriptor::{DType, KvLayout, OwnerLease, Role, TensorOrder};

/// The size of the filesystem behind [`SHM_DIR`] in bytes, `None` when it
/// reports none (a tmpfs without a size limit).
fn shm_size() -> Option<u64> {
    let st = rustix::fs::statvfs(SHM_DIR).expect("statvfs /dev/shm");
    (st.f_blocks > 0).then(|| st.f_blocks * st.f_frsize)
}

/// Entries of [`SHM_DIR`] whose name starts with `prefix`.
fn entries(prefix: &str) -> Vec<String> {
    std::fs::read_dir(SHM_DIR)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(prefix))
        .collect()
}

#[test]
fn a_segment_larger_than_dev_shm_is_refused_at_creation() {
    let Some(size) = shm_size() else {
        eprintln!("{SHM_DIR} has no size limit: no segment is refused up front, test not run");
        return;
    };
    let len = size + (1 << 20);
    let name = format!("/kvbank-space-{}-seg", std::process::id());
    match HostShmMemory::create(&name, len as usize) {
        Err(BankError::ShmNoSpace {
            field: "len",
            bytes,
            free_bytes: Some(free),
        }) => {
            assert_eq!(bytes, len);
            assert!(free <= size, "free {free} > size {size}");
        }
        Err(other) => panic!("expected ShmNoSpace naming `len`, got {other}"),
        Ok(m) => panic!(
            "a {len}-byte segment on a {size}-byte {SHM_DIR} was created ({}); its first \
             write past the free space would raise SIGBUS",
            m.name()
        ),
    }
    assert!(
        !Path::new(&format!("{SHM_DIR}{name}")).exists(),
        "the refused segment was left behind"
    );
}

#[test]
fn a_bank_larger_than_dev_shm_is_refused_naming_budget_bytes_and_leaves_nothing() {
    let Some(size) = shm_size() else {
        eprintln!("{SHM_DIR} has no size limit: no bank is refused up front, test not run");
        return;
    };
    // 8 MiB rank blocks, so the slot count stays far below MAX_SLOTS.
    let layout = KvLayout::new(32, 8, 128, DType::F32, 64, TensorOrder::BlockMajor, 2).unwrap();
    let rank_bytes = layout.rank_block_bytes() as u64;
    let slots = size / rank_bytes + 1; // each rank alone exceeds the filesystem
    let mut cfg = BankConfig::new(
        layout,
        OwnerLease::fresh(Role::Decode),
        slots * layout.block_bytes() as u64,
    );
    let prefix = format!("kvbank-space-{}-bank", std::process::id());
    cfg.shm_prefix = prefix.clone();
    match BankManager::new_host_shm(cfg, "test-host") {
        Err(e @ BankError::ShmNoSpace { .. }) => {
            let BankError::ShmNoSpace {
                field,
                bytes,
                free_bytes,
            } = &e
            else {
                unreachable!()
            };
            assert_eq!(*field, "budget_bytes");
            assert_eq!(
                *bytes,
                slots * 2 * rank_bytes,
                "every rank's bytes together"
            );
            assert!(free_bytes.is_some_and(|f| f <= size));
            let text = e.to_string();
            assert!(
                text.starts_with("`budget_bytes`: ") && text.contains(SHM_DIR),
                "{text}"
            );
        }
        Err(other) => panic!("expected ShmNoSpace naming `budget_bytes`, got {other}"),
        Ok(bank) => panic!(
            "a bank of {slots} slots x 2 ranks x {rank_bytes} bytes on a {size}-byte \
             {SHM_DIR} was created: {:?}",
            bank.lease_status().names
        ),
    }
    assert_eq!(
        entries(&prefix),
        Vec::<String>::new(),
        "segments or leases left behind"
    );
}
