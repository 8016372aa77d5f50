//! `docs/wire-formats.md` against its sources: every kv-descriptor wire
//! snapshot appears verbatim, its bytes decode as the documented type, and
//! the generated examples (Dynamo router event, vLLM batch) are what the code
//! produces. `KV_UPDATE_WIRE_DOC=1` rewrites the examples instead.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use kv_descriptor::*;
use kv_lookup::{InventoryIndex, WorkerKey};
use kv_router_glue::dynamo_events::DynamoRouterEvent;
use kv_router_glue::vllm_events::*;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Snapshot bodies by name (`wire_snapshots__*` only: those are wire types).
fn snapshots() -> BTreeMap<String, String> {
    let dir = root().join("crates/kv-descriptor/tests/snapshots");
    let mut out = BTreeMap::new();
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_owned();
        if !name.starts_with("wire_snapshots__") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // insta header: `---`, metadata lines, `---`, then the body.
        let body = text.splitn(3, "---\n").nth(2).expect("insta header");
        out.insert(name, body.trim_end().to_owned());
    }
    out
}

/// The hex bytes of a snapshot body.
fn bytes_of(body: &str) -> Vec<u8> {
    let hex: String = body
        .lines()
        .skip_while(|l| *l != "hex:")
        .skip(1)
        .take_while(|l| *l != "json:")
        .collect();
    (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
        .collect()
}

/// Decodes snapshot `name`'s bytes as the type it documents.
fn decodes_as_documented(name: &str, bytes: &[u8]) -> Result<(), String> {
    let kind = name.trim_start_matches("wire_snapshots__");
    let r = if kind.starts_with("bank_descriptor") {
        BankDescriptor::from_wire(bytes).map(drop)
    } else if kind.starts_with("bank_manifest") {
        BankManifest::from_wire(bytes).map(drop)
    } else if kind == "fetch_gpu_hint" {
        FetchGpuHint::from_wire(bytes).map(drop)
    } else if kind == "hint_envelope" {
        HintEnvelope::from_wire(bytes).map(drop)
    } else if kind.starts_with("kv_event") {
        KvEvent::from_wire(bytes).map(drop)
    } else if kind == "pin_request" || kind == "pin_release" {
        PinClientMessage::from_wire(bytes).map(drop)
    } else if kind.starts_with("pin_") {
        PinDonorMessage::from_wire(bytes).map(drop)
    } else {
        return Err(format!("{name}: no documented type; add it to wire_doc.rs"));
    };
    r.map_err(|e| format!("{name}: {e}"))
}

fn generated(snaps: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let removed =
        KvEvent::from_wire(&bytes_of(&snaps["wire_snapshots__kv_event_removed"])).unwrap();
    let d = DynamoRouterEvent::from_kv_event(&removed, WorkerKey(9001));
    let bytes = d.to_msgpack().unwrap();
    let hex: Vec<String> = bytes
        .chunks(32)
        .map(|c| c.iter().map(|b| format!("{b:02x}")).collect())
        .collect();
    out.insert(
        "dynamo_router_event_removed".to_owned(),
        format!(
            "msgpack ({} bytes):\n{}\njson:\n{}",
            bytes.len(),
            hex.join("\n"),
            serde_json::to_string_pretty(&d).unwrap()
        ),
    );

    let payload =
        "93cb3ff80000000000009197ab426c6f636b53746f726564910 7c09401020304 04c0a347505500"
            .replace(' ', "");
    let payload: Vec<u8> = (0..payload.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&payload[i..i + 2], 16).unwrap())
        .collect();
    let batch = decode_batch(&payload).unwrap();
    let index = Arc::new(InventoryIndex::new());
    let worker = VllmWorker {
        key: WorkerKey(1),
        engine: EngineId(uuid::Uuid::from_u128(0xE1E1)),
        role: Role::Prefill,
        layout_fingerprint: LayoutFingerprint(1),
        tp_size: 1,
        tokens_per_block: 4,
    };
    let mut ingest = VllmIngest::new(index.clone(), worker).unwrap();
    ingest.apply_batch(&batch);
    let ours = ingest.sequence_hash(7).unwrap();
    assert_eq!(ours, sequence_hashes(&[1, 2, 3, 4], 4)[0]);
    out.insert(
        "vllm_block_stored".to_owned(),
        format!(
            "payload ({} bytes): {}\ndecoded: {:?}\nindexed: block 7 -> sequence hash {} in tier {:?}",
            payload.len(),
            payload.iter().map(|b| format!("{b:02x}")).collect::<String>(),
            batch,
            ours.0,
            index.holds(worker.engine, ours),
        ),
    );
    out
}

/// Replaces or checks every `<!-- KIND: NAME -->` ... `<!-- /KIND -->` block.
fn sync(
    doc: &str,
    kind: &str,
    sources: &BTreeMap<String, String>,
    problems: &mut Vec<String>,
) -> String {
    let open = format!("<!-- {kind}: ");
    let close = format!("<!-- /{kind} -->");
    let mut out = String::new();
    let mut rest = doc;
    let mut seen = Vec::new();
    while let Some(at) = rest.find(&open) {
        let name_end = rest[at..].find(" -->").unwrap() + at;
        let name = rest[at + open.len()..name_end].to_owned();
        let end = rest[name_end..].find(&close).expect("closing marker") + name_end;
        let current = rest[name_end + 4..end].trim();
        match sources.get(&name) {
            Some(src) => {
                let want = format!("```text\n{src}\n```");
                if current != want {
                    problems.push(format!("{kind} {name} differs from its source"));
                }
                out.push_str(&rest[..name_end + 4]);
                out.push('\n');
                out.push_str(&want);
                out.push('\n');
            }
            None => {
                problems.push(format!("{kind} {name} has no source"));
                out.push_str(&rest[..end]);
            }
        }
        seen.push(name);
        out.push_str(&close);
        rest = &rest[end + close.len()..];
    }
    out.push_str(rest);
    for name in sources.keys() {
        if !seen.contains(name) {
            problems.push(format!("{kind} {name} is not in docs/wire-formats.md"));
        }
    }
    out
}

#[test]
fn wire_doc_matches_snapshots_and_code() {
    let path = root().join("docs/wire-formats.md");
    let doc = std::fs::read_to_string(&path).unwrap();
    let snaps = snapshots();
    assert!(snaps.len() >= 10, "snapshots found: {:?}", snaps.keys());
    for (name, body) in &snaps {
        decodes_as_documented(name, &bytes_of(body)).unwrap();
    }
    let mut problems = Vec::new();
    let doc2 = sync(&doc, "snapshot", &snaps, &mut problems);
    let doc3 = sync(&doc2, "generated", &generated(&snaps), &mut problems);
    if std::env::var_os("KV_UPDATE_WIRE_DOC").is_some() {
        std::fs::write(&path, doc3).unwrap();
        return;
    }
    assert!(
        problems.is_empty(),
        "docs/wire-formats.md is stale (KV_UPDATE_WIRE_DOC=1 regenerates):\n{}",
        problems.join("\n")
    );
}
