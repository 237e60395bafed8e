//! The `GET /metrics` endpoint of the driver and the controller: the `--metrics-addr` flag, the
//! exposition of a `prometheus-client` registry, and the HTTP server; and how both processes end
//! on a panic.
//!
//! Prometheus asks for OpenMetrics and gets it. Anything else (curl, `promtool check metrics`,
//! older scrapers) gets the classic text format 0.0.4, which some tools still read exclusively.

use std::future::Future;
use std::net::SocketAddr;

use prometheus_client::registry::Registry;

pub const OPENMETRICS_CONTENT_TYPE: &str =
    "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const TEXT_CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Makes any panic end the process after the usual message, as `panic = "abort"` would: a panic
/// in a driver or controller task is a bug, and carrying on without that task (tokio would) leaves
/// the process half alive. The workspace builds with unwinding for the enforcement library's sake.
pub fn abort_on_panic() {
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        report(info);
        std::process::abort();
    }));
}

/// `--metrics-addr`: `host:port`, `:port` for every address, or empty for no endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ListenAddr(pub Option<SocketAddr>);

pub fn parse_listen_addr(value: &str) -> Result<ListenAddr, String> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(ListenAddr(None));
    }
    let full = match value.strip_prefix(':') {
        Some(port) => format!("0.0.0.0:{port}"),
        None => value.to_string(),
    };
    full.parse::<SocketAddr>()
        .map(|a| ListenAddr(Some(a)))
        .map_err(|e| format!("{value:?}: {e}; expected host:port, :port, or empty to turn it off"))
}

/// The registry's exposition, as OpenMetrics or in the classic text format.
pub fn encode(registry: &Registry, openmetrics: bool) -> String {
    let mut text = String::new();
    if let Err(e) = prometheus_client::encoding::text::encode(&mut text, registry) {
        tracing::warn!(error = %e, "encoding the metrics");
    }
    if openmetrics {
        text
    } else {
        openmetrics_to_text(&text)
    }
}

/// OpenMetrics as `prometheus-client` writes it, in the classic text format 0.0.4: a counter's
/// HELP and TYPE name the `_total` series, and there is no UNIT or EOF line.
pub fn openmetrics_to_text(openmetrics: &str) -> String {
    let counters: std::collections::HashSet<&str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.strip_suffix(" counter"))
        .collect();
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ')?;
            counters
                .contains(name)
                .then(|| format!("{prefix}{name}_total {tail}"))
        });
        out.push_str(renamed.as_deref().unwrap_or(line));
        out.push('\n');
    }
    out
}

/// Binds the metrics endpoint, so that a taken port fails the start rather than going unnoticed.
pub async fn bind(addr: SocketAddr) -> anyhow::Result<tokio::net::TcpListener> {
    use anyhow::Context;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the metrics endpoint {addr} (--metrics-addr)"))?;
    // The e2e harness and the sandbox read the bound port from this line
    // (`--metrics-addr 127.0.0.1:0`).
    if let Ok(bound) = listener.local_addr() {
        tracing::info!(metrics_addr = %bound, "serving GET /metrics");
    }
    Ok(listener)
}

fn wants_openmetrics(headers: &axum::http::HeaderMap) -> bool {
    headers
        .get_all(axum::http::header::ACCEPT)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .any(|v| v.contains("application/openmetrics-text"))
}

/// GET /metrics until `shutdown` completes; `render(openmetrics)` makes each answer's body.
pub async fn serve<R, F>(
    listener: tokio::net::TcpListener,
    render: R,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()>
where
    R: Fn(bool) -> F + Clone + Send + Sync + 'static,
    F: Future<Output = String> + Send + 'static,
{
    use anyhow::Context;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move |headers: axum::http::HeaderMap| {
            let render = render.clone();
            async move {
                let openmetrics = wants_openmetrics(&headers);
                let content_type = if openmetrics {
                    OPENMETRICS_CONTENT_TYPE
                } else {
                    TEXT_CONTENT_TYPE
                };
                (
                    [(axum::http::header::CONTENT_TYPE, content_type)],
                    render(openmetrics).await,
                )
            }
        }),
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("metrics endpoint")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metrics_address_takes_a_port_alone_a_full_address_or_nothing() {
        assert_eq!(
            parse_listen_addr(":9464").unwrap().0,
            Some("0.0.0.0:9464".parse().unwrap())
        );
        assert_eq!(
            parse_listen_addr("127.0.0.1:0").unwrap().0,
            Some("127.0.0.1:0".parse().unwrap())
        );
        assert_eq!(parse_listen_addr("").unwrap().0, None);
        let err = parse_listen_addr("metrics").unwrap_err();
        assert!(err.contains("host:port"), "{err}");
    }

    #[test]
    fn the_text_format_names_counters_by_their_series_and_has_no_openmetrics_lines() {
        let openmetrics = "# HELP a_requests Requests.\n# TYPE a_requests counter\na_requests_total{r=\"x\"} 1\n\
                           # HELP b_seconds Time.\n# TYPE b_seconds histogram\n# UNIT b_seconds seconds\nb_seconds_count 0\n\
                           # HELP c Gauge.\n# TYPE c gauge\nc 2\n# EOF\n";
        assert_eq!(
            openmetrics_to_text(openmetrics),
            "# HELP a_requests_total Requests.\n# TYPE a_requests_total counter\na_requests_total{r=\"x\"} 1\n\
             # HELP b_seconds Time.\n# TYPE b_seconds histogram\nb_seconds_count 0\n\
             # HELP c Gauge.\n# TYPE c gauge\nc 2\n"
        );
    }
}
