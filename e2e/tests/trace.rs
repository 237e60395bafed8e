//! The short trace run (issue 31): a tenth of the openb trace's nodes and one seed through the real
//! kube-scheduler, in the benchmark's two reference modes (whole cards and stock shares; the other
//! modes run the same code with another profile or pod spec, and the bench runs them), checked for
//! what a reader of BENCHMARKS.md relies on: each mode produces its figures, no more GPU is placed
//! than the cluster has, and shares leave no more unallocated than whole cards. The trace folder comes from `GPUPOOL_TRACE_DIR` (CI passes the
//! published one); without it, or without the control plane binaries, the scenario skips, and
//! fails instead where `GPUPOOL_KUBE_REQUIRED` says they must be there.

use std::path::PathBuf;

use gpupool_e2e::plane::binaries::required;
use gpupool_e2e::plane::KubeBinaries;
use gpupool_e2e::trace::runner::{run, RunResult, RunSpec, TRACE_DIR_ENV};
use gpupool_e2e::trace::Mode;

fn inputs_or_skip() -> Option<PathBuf> {
    let missing = match (KubeBinaries::from_env(), std::env::var_os(TRACE_DIR_ENV)) {
        (Ok(_), Some(dir)) => return Some(PathBuf::from(dir)),
        (Err(why), _) => why,
        (Ok(_), None) => format!("{TRACE_DIR_ENV} names no trace folder"),
    };
    if required() {
        panic!("the short trace run cannot run: {missing}");
    }
    println!("skipping the short trace run: {missing}");
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenth_of_the_trace_through_kube_scheduler_gives_sane_figures() {
    let Some(trace_dir) = inputs_or_skip() else {
        return;
    };
    let spec = |mode| RunSpec {
        trace_dir: trace_dir.clone(),
        trace: "default".into(),
        mode,
        seed: 42,
        node_fraction: 0.1,
        etcd_fsync: false,
    };
    // Both at once, a plane each: a run waits on kube-scheduler more than it computes. Three
    // modes took four minutes on a loaded 2-core machine, over what CI may spend here.
    let modes = [Mode::Whole, Mode::Shares];
    let runs = futures::future::join_all(modes.iter().map(|&m| {
        let spec = spec(m);
        async move { run(&spec).await }
    }))
    .await;
    let results: Vec<RunResult> = runs
        .into_iter()
        .map(|r| r.unwrap_or_else(|e| panic!("{e}")))
        .collect();
    for r in &results {
        let mode = r.mode.name();
        let at_100 = r
            .unallocated_at_100
            .unwrap_or_else(|| panic!("{mode}: no figure at 100 % arrived"));
        assert!(r.placed_milli <= r.capacity_milli, "{mode}: {r:?}");
        assert!((0.0..=100.0).contains(&at_100), "{mode}: {at_100}");
        assert!(r.unallocated_at_130 <= at_100 + 1e-9, "{mode}: {r:?}");
        assert_eq!(r.placed + r.refused, r.tasks, "{mode}");
        // At 130 % arrived something must have been refused, and most tasks placed.
        assert!(r.refused > 0 && r.placed > r.refused, "{mode}: {r:?}");
        assert!(r.pods_per_second > 0.0, "{mode}");
        assert!(r.curve.len() >= 100, "{mode}: {} points", r.curve.len());
        println!(
            "{mode}: unallocated at 100 % {at_100:.2}, at 130 % {:.2}, placed {} refused {}, {:.1} pods/s",
            r.unallocated_at_130, r.placed, r.refused, r.pods_per_second
        );
    }
    let at_100 = |mode: Mode| {
        results
            .iter()
            .find(|r| r.mode == mode)
            .and_then(|r| r.unallocated_at_100)
            .unwrap()
    };
    assert!(
        at_100(Mode::Shares) <= at_100(Mode::Whole),
        "shares leave {:.2} % unallocated, whole cards {:.2} %",
        at_100(Mode::Shares),
        at_100(Mode::Whole)
    );
}
