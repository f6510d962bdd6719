//! The operator's HTTP endpoints: `/metrics` (OpenMetrics), `/healthz`, `/readyz`.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::routing::get;
use axum::Router;

use super::Metrics;

/// The content type of `/metrics`: what `prometheus_client`'s text encoder writes (OpenMetrics
/// 1.0, ending in `# EOF`), so that Prometheus parses it as such.
pub const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The HTTP routes.
pub fn router(metrics: Arc<Metrics>) -> Router {
    Router::new()
        .route(
            "/metrics",
            get(|State(m): State<Arc<Metrics>>| async move {
                ([(header::CONTENT_TYPE, OPENMETRICS)], m.encode())
            }),
        )
        .route(
            "/healthz",
            get(|State(m): State<Arc<Metrics>>| async move {
                match m.health() {
                    Ok(()) => (StatusCode::OK, "ok".to_string()),
                    Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                }
            }),
        )
        .route(
            "/readyz",
            get(|State(m): State<Arc<Metrics>>| async move {
                if m.ready.load(Ordering::Relaxed) {
                    (StatusCode::OK, "ready")
                } else {
                    (StatusCode::SERVICE_UNAVAILABLE, "not ready")
                }
            }),
        )
        .with_state(metrics)
}

/// Serve the routes on `addr` until the process ends.
pub async fn serve(addr: std::net::SocketAddr, metrics: Arc<Metrics>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    serve_on(listener, metrics).await
}

/// Serve the routes on a bound listener until the process ends.
pub async fn serve_on(
    listener: tokio::net::TcpListener,
    metrics: Arc<Metrics>,
) -> std::io::Result<()> {
    axum::serve(listener, router(metrics)).await
}
