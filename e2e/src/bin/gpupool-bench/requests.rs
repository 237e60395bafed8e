//! Which API requests the driver made (pure): the emulator logs method, path and user agent; the
//! bench's own client carries [`BENCH_USER_AGENT`], so everything else came from a driver.

use std::collections::BTreeMap;

use gpupool_apiserver::RequestRecord;

use crate::report::CycleRequests;

pub const BENCH_USER_AGENT: &str = "gpupool-bench";

/// Made by the bench's own client (which the kubelet emulator shares), not by a driver.
pub fn is_bench(record: &RequestRecord) -> bool {
    record.user_agent.starts_with(BENCH_USER_AGENT)
}

/// `METHOD resource[/subresource][ watch]`, e.g. `POST resourceslices`, `GET gpumodels watch`,
/// `PATCH resourceclaims/status`.
pub fn request_kind(method: &str, path_and_query: &str) -> String {
    let (path, query) = path_and_query
        .split_once('?')
        .unwrap_or((path_and_query, ""));
    let segments: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    // /api/v1/... or /apis/<group>/<version>/...
    let rest: &[&str] = match segments.first() {
        Some(&"api") => segments.get(2..).unwrap_or(&[]),
        Some(&"apis") => segments.get(3..).unwrap_or(&[]),
        _ => &[],
    };
    let rest = match rest {
        ["namespaces", _, tail @ ..] if !tail.is_empty() => tail,
        other => other,
    };
    let resource = match rest {
        [] => path.to_string(),
        [resource] | [resource, _] => resource.to_string(),
        [resource, _, sub, ..] => format!("{resource}/{sub}"),
    };
    let watch = query
        .split('&')
        .any(|kv| kv == "watch=true" || kv == "watch=1");
    if watch {
        format!("{method} {resource} watch")
    } else {
        format!("{method} {resource}")
    }
}

pub fn is_write(method: &str) -> bool {
    matches!(method, "POST" | "PUT" | "PATCH" | "DELETE")
}

/// Requests the drivers made (not the bench), counted by kind.
pub fn driver_requests(records: &[RequestRecord]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for record in records.iter().filter(|r| !is_bench(r)) {
        *counts
            .entry(request_kind(&record.method, &record.path))
            .or_default() += 1;
    }
    counts
}

/// A read with a `resourceVersion`, which the API server answers from its watch cache.
pub fn is_cached_read(record: &RequestRecord) -> bool {
    let query = record.path.split_once('?').map_or("", |(_, q)| q);
    record.method == "GET"
        && query.split('&').any(|kv| {
            kv.strip_prefix("resourceVersion=")
                .is_some_and(|v| !v.is_empty())
        })
        && !query
            .split('&')
            .any(|kv| kv == "watch=true" || kv == "watch=1")
}

/// The drivers' reads (GETs that are not watches) and writes over `cycles` prepare+unprepare
/// cycles.
pub fn per_cycle(records: &[RequestRecord], cycles: usize) -> CycleRequests {
    let by_kind = driver_requests(records);
    let cached_reads = records
        .iter()
        .filter(|r| !is_bench(r) && is_cached_read(r))
        .count();
    let (mut reads, mut writes) = (0, 0);
    for (kind, n) in &by_kind {
        let method = kind.split(' ').next().unwrap_or_default();
        if is_write(method) {
            writes += n;
        } else if method == "GET" && !kind.ends_with(" watch") {
            reads += n;
        }
    }
    let per = |n: usize| n as f64 / cycles.max(1) as f64;
    CycleRequests {
        cycles,
        reads,
        cached_reads,
        writes,
        reads_per_cycle: per(reads),
        cached_reads_per_cycle: per(cached_reads),
        writes_per_cycle: per(writes),
        by_kind,
    }
}

/// Writes to ResourceSlices among counted requests.
pub fn slice_writes(counts: &BTreeMap<String, usize>) -> usize {
    counts
        .iter()
        .filter(|(kind, _)| {
            let mut parts = kind.split(' ');
            let method = parts.next().unwrap_or_default();
            let resource = parts.next().unwrap_or_default();
            is_write(method) && resource == "resourceslices"
        })
        .map(|(_, n)| n)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(method: &str, path: &str, agent: &str) -> RequestRecord {
        RequestRecord {
            method: method.into(),
            path: path.into(),
            user_agent: agent.into(),
        }
    }

    #[test]
    fn kinds_of_typical_driver_requests() {
        assert_eq!(
            request_kind("POST", "/apis/resource.k8s.io/v1/resourceslices?"),
            "POST resourceslices"
        );
        assert_eq!(
            request_kind(
                "GET",
                "/apis/resource.k8s.io/v1/resourceslices?fieldSelector=spec.nodeName%3Dn1"
            ),
            "GET resourceslices"
        );
        assert_eq!(
            request_kind(
                "PUT",
                "/apis/resource.k8s.io/v1/resourceslices/n1-gpupool.dev-x"
            ),
            "PUT resourceslices"
        );
        assert_eq!(request_kind("GET", "/api/v1/nodes/n1"), "GET nodes");
        assert_eq!(
            request_kind(
                "GET",
                "/apis/gpupool.dev/v1alpha1/gpumodels?&watch=true&resourceVersion=5"
            ),
            "GET gpumodels watch"
        );
        assert_eq!(
            request_kind(
                "PATCH",
                "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/c1/status"
            ),
            "PATCH resourceclaims/status"
        );
        assert_eq!(
            request_kind(
                "GET",
                "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/c1"
            ),
            "GET resourceclaims"
        );
        assert_eq!(
            request_kind("POST", "/api/v1/namespaces/bench/events"),
            "POST events"
        );
        assert_eq!(request_kind("GET", "/version"), "GET /version");
    }

    #[test]
    fn the_bench_own_requests_are_left_out_and_slice_writes_counted() {
        let records = vec![
            record(
                "GET",
                "/apis/resource.k8s.io/v1/resourceslices",
                "kube-rs/3",
            ),
            record(
                "POST",
                "/apis/resource.k8s.io/v1/resourceslices",
                "kube-rs/3",
            ),
            record(
                "POST",
                "/apis/resource.k8s.io/v1/resourceslices",
                "kube-rs/3",
            ),
            record("GET", "/api/v1/nodes/n1", "kube-rs/3"),
            record(
                "GET",
                "/apis/resource.k8s.io/v1/resourceslices",
                "gpupool-bench/0.1.0",
            ),
            record(
                "POST",
                "/apis/resource.k8s.io/v1/resourceslices",
                BENCH_USER_AGENT,
            ),
        ];
        let counts = driver_requests(&records);
        assert_eq!(counts.values().sum::<usize>(), 4);
        assert_eq!(counts["POST resourceslices"], 2);
        assert_eq!(slice_writes(&counts), 2);
    }

    #[test]
    fn reads_and_writes_per_cycle_leave_out_watches_and_the_bench() {
        let claim = "/apis/resource.k8s.io/v1/namespaces/bench/resourceclaims/c1";
        let status = format!("{claim}/status");
        let records = vec![
            record("GET", claim, "kube-rs/3"),
            record("PATCH", &status, "kube-rs/3"),
            record("GET", &format!("{claim}?&resourceVersion=0"), "kube-rs/3"),
            record("PATCH", &status, "kube-rs/3"),
            record("PATCH", &status, "kube-rs/3"),
            record(
                "GET",
                "/apis/gpupool.dev/v1alpha1/gpumodels?watch=true&resourceVersion=5",
                "kube-rs/3",
            ),
            record("POST", "/api/v1/namespaces/bench/events", "kube-rs/3"),
            record("GET", claim, "gpupool-bench/0.1.0"),
            record("PATCH", &status, BENCH_USER_AGENT),
        ];
        let counts = per_cycle(&records, 2);
        assert_eq!((counts.reads, counts.writes), (2, 4));
        assert_eq!(counts.cached_reads, 1);
        assert_eq!(counts.cached_reads_per_cycle, 0.5);
        assert_eq!(counts.reads_per_cycle, 1.0);
        assert_eq!(counts.writes_per_cycle, 2.0);
        assert_eq!(counts.by_kind["GET gpumodels watch"], 1);
        assert_eq!(counts.by_kind["PATCH resourceclaims/status"], 3);
        assert_eq!(per_cycle(&[], 0).reads_per_cycle, 0.0);
    }
}
