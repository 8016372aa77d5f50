//! Both worker roles in one process over the embedded (in-process) planes:
//! a decode worker's [`DonorAgent`] stores a prompt's sealed KV blocks, a
//! router (kv-lookup index + advisor over a [`RemoteDonorDirectory`] fed
//! only by the planes) advises, and a prefill worker's [`TargetAgent`]
//! fetches the prefix; then the donor closes and the same request falls
//! back to recompute.
//!
//! Run: `cargo run -p kv-router-glue --example two_role`. Across processes
//! the same calls run with a [`NatsPlane`] and a [`NatsDirectory`] in place
//! of the in-process ones (docs/agents.md).

use std::sync::Arc;
use std::time::Duration;

use kv_bank::{sealed_blocks, BankConfig, BankMemory, DestinationPool, StoreStatus};
use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerInfo, WorkerKey};
use kv_router_glue::*;
use kv_transfer::{DeliveryControl, HostBuffer, HostCopyBackend};

const TP: u32 = 2;
const TOKENS: usize = 16;
const BLOCKS: usize = 32;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let layout = KvLayout::new(
        2,
        4,
        8,
        DType::F32,
        TOKENS as u32,
        TensorOrder::BlockMajor,
        TP,
    )?;
    let rbb = layout.rank_block_bytes();
    let plane: Arc<dyn EventPlane> = Arc::new(InProcessPlane::new());
    let directory = Arc::new(InProcessDirectory::new());
    let events = Subject::new("example", "decode", "kv_events")?;
    let sock = std::env::temp_dir().join(format!("kv-two-role-{}.sock", std::process::id()));

    // Router side: subscribed before the donor publishes anything.
    let index = Arc::new(InventoryIndex::new());
    let remote = Arc::new(RemoteDonorDirectory::new());
    let mut receiver =
        KvEventReceiver::subscribe(plane.clone(), &events, Duration::from_secs(1)).await?;
    let mut watch = directory.watch().await?;
    let target_engine = EngineId::fresh();
    index.register_worker(
        WorkerKey(2),
        WorkerInfo {
            engine: target_engine,
            role: Role::Prefill,
            layout_fingerprint: layout.fingerprint(),
            tp_size: TP,
        },
    )?;
    let settings = ReuseSettings {
        enable_decode_to_prefill_reuse: true,
        ..ReuseSettings::default()
    };
    let advisor = Advisor::new(
        index.clone(),
        remote.clone(),
        LiveCostModel::new(CostModel::new(settings, TOKENS as u32)?),
        Arc::new(DecisionLog::new(16)),
        16_384,
    );

    // Decode worker: open the agent, store one prompt's sealed blocks.
    let gpus = (0..TP)
        .map(|r| GpuIdentity::new(uuid::Uuid::from_u128(u128::from(r) + 1), r, "example"))
        .collect::<Result<Vec<_>, _>>()?;
    let donor = DonorAgent::open(
        DonorAgentConfig {
            worker_key: "decode-0".into(),
            bank: BankConfig::new(layout, OwnerLease::fresh(Role::Decode), 64 * 2 * rbb as u64),
            host_id: "example".into(),
            cuda_ordinals: None,
            gpus,
            pin_endpoint: format!("unix:{}", sock.display()),
            pin_auth_key: None,
            pin_config: PinServiceConfig::default(),
            namespace: "example".into(),
            event_subject: events.clone(),
            event_ring: 256,
            record_ttl: Duration::from_secs(10),
        },
        directory.clone(),
        plane.clone(),
    )
    .await?;
    let tokens: Vec<u32> = (0..(BLOCKS * TOKENS) as u32).collect();
    let blocks = sealed_blocks(None, &tokens, TOKENS);
    let hashes: Vec<SequenceHash> = blocks.iter().map(|b| b.sequence_hash).collect();
    let store = donor.store(None, &blocks)?;
    for rank in 0..TP {
        for (i, (h, _)) in store.entries.iter().enumerate() {
            // Stands in for the engine's device-to-bank copy of rank `rank`'s KV.
            let bytes: Vec<u8> = (0..rbb).map(|j| (h.0 as usize + j) as u8).collect();
            donor
                .bank()
                .write_pending(store.store_id, rank, i, &bytes)?;
        }
    }
    for rank in 0..TP {
        if donor.ack(store.store_id, rank).await? == StoreStatus::Ready {
            println!("donor: {BLOCKS} blocks ready, Stored events published");
        }
    }

    // Router: take in the record and the events, then advise.
    while let Some(c) = watch.try_next() {
        remote.apply_directory(c);
    }
    while let Some(KvStreamItem::Event(e)) = receiver.next_timeout(Duration::from_millis(20)).await
    {
        index.apply_event(&e)?;
        remote.ingest_event(&e);
    }
    let advice = advisor.advise("req-1", &hashes, target_engine);
    println!("router: {}", advice.decision);
    let envelope = advice.hint.ok_or("no hint")?;

    // Prefill worker: fetch into its own block regions.
    let rows: Vec<Arc<dyn BankMemory>> = (0..TP)
        .map(|_| HostBuffer::zeroed(64 * rbb).map(|b| Arc::new(b) as Arc<dyn BankMemory>))
        .collect::<Result<_, _>>()?;
    let executor = FetchExecutor::new(
        layout,
        DestinationPool::new(64),
        rows,
        64,
        Arc::new(HostCopyBackend),
    )?;
    let target = TargetAgent::connect(executor, directory.clone(), None).await?;
    let out = target.fetch(&envelope, &hashes, &DeliveryControl::new())?;
    println!(
        "target: fetched {} blocks, {} bytes",
        out.fetched.len(),
        out.report.counters.bytes
    );
    drop(out);

    // The donor closes: record deleted, Cleared published; the retry falls back.
    let report = donor.close(Duration::from_secs(1)).await?;
    println!("donor: closed, {} pin(s) granted", report.pin_stats.granted);
    while let Some(c) = watch.try_next() {
        remote.apply_directory(c);
    }
    match target.fetch(&envelope, &hashes, &DeliveryControl::new()) {
        Ok(_) => return Err("a closed donor was fetched from".into()),
        Err(e) => println!("target: falls back to recompute: {e}"),
    }
    Ok(())
}
