//! The local cluster end to end (`kv_testkit::cluster`): nats-server, a
//! router process, 2 decode and 2 prefill processes (this crate's `kvq`
//! binary, `kvq child cluster-*`), 240 multi-turn requests and four faults
//! across processes. Skips with a printed reason without nats-server
//! (outside CI). About 10 s on 2 cores.

use kv_testkit::cluster::{run, ClusterError, ClusterOptions, ClusterReport, RouterProcess};
use kv_testkit::faults::ChildCommand;

fn kvq() -> ChildCommand {
    ChildCommand {
        exe: env!("CARGO_BIN_EXE_kvq").into(),
        args: vec!["child".into()],
    }
}

/// One cluster at a time: both tests start from this process, whose pid
/// names the harness's sockets and scratch paths; two overlapping runs hung
/// the product-router one on a 2-core machine.
static ONE_CLUSTER: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn cluster(test: &str, router: &RouterProcess) -> Option<ClusterReport> {
    let _one = ONE_CLUSTER.lock().unwrap_or_else(|p| p.into_inner());
    match run(&ClusterOptions::default(), &kvq(), router) {
        Ok(r) => Some(r),
        Err(ClusterError::Skipped(why)) => {
            println!("SKIP {test}: {why}");
            None
        }
        Err(e) => panic!("{test}: {e}"),
    }
}

fn assert_accepted(r: &ClusterReport) {
    assert!(r.failures().is_empty(), "{:?}\n{r:#?}", r.failures());
    assert!(r.requests >= 200, "{}", r.requests);
    assert_eq!(
        (r.wrong_outputs, r.false_completions, r.leaks),
        (0, 0, 0),
        "{r:#?}"
    );
    let faults: Vec<&str> = r.recoveries.iter().map(|x| x.fault.as_str()).collect();
    assert_eq!(
        faults,
        [
            "donor_restarted_new_incarnation",
            "decode_killed_mid_fetch",
            "router_restarted",
            "nats_server_restarted"
        ]
    );
    // The kill landed inside a fetch, which fell back.
    assert!(r.fallbacks >= 1, "{r:#?}");
    // The router was down for the probe turn: those requests recomputed.
    assert!(r.advise_unavailable >= 1, "{r:#?}");
    assert!(r.advise_p50_us > 0 && r.advise_p99_us >= r.advise_p50_us);
}

#[test]
fn cluster_with_the_stand_in_router_serves_reuses_and_recovers_from_every_fault() {
    let Some(r) = cluster("cluster_stand_in", &RouterProcess::StandIn) else {
        return;
    };
    assert_eq!(r.router, "kvq stand-in");
    assert_accepted(&r);
}

/// The product router binary, when built next to kvq
/// (`cargo build -p kv-router-glue --bin kv-reuse-router`).
#[test]
fn cluster_with_the_product_router_recovers_from_every_fault() {
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_kvq"));
    let router = RouterProcess::find(&exe);
    if router == RouterProcess::StandIn {
        // Under CI the product router must be tested, not skipped.
        assert!(
            !kv_transfer::ci_requires(),
            "cluster_product_router: kv-reuse-router is not built next to kvq (CI=true)"
        );
        println!("SKIP cluster_product_router: kv-reuse-router is not built next to kvq");
        return;
    }
    let Some(r) = cluster("cluster_product_router", &router) else {
        return;
    };
    assert_accepted(&r);
}
