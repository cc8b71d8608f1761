//! Logging, plus a capture of the plans that `auto_explain` sends as NOTICEs to the claim
//! phase's sessions (tokio-postgres logs notices through `log`, bridged into tracing).

use std::sync::Mutex;

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

static PLANS: Mutex<Vec<String>> = Mutex::new(Vec::new());

/// Takes the plans captured so far.
pub fn take() -> Vec<String> {
    std::mem::take(&mut *PLANS.lock().unwrap_or_else(|p| p.into_inner()))
}

struct Capture;

struct Message(String);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.0 = value.to_owned();
        }
    }
}

impl<S: Subscriber> Layer<S> for Capture {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let mut m = Message(String::new());
        event.record(&mut m);
        if m.0.contains("plan:") {
            PLANS.lock().unwrap_or_else(|p| p.into_inner()).push(m.0);
        }
    }
}

/// Errors (or `BENCH_LOG`) to stderr; auto_explain notices to [`take`].
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("BENCH_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(filter);
    let capture = Capture.with_filter(filter_fn(|m| m.target().starts_with("tokio_postgres")));
    tracing_subscriber::registry()
        .with(fmt)
        .with(capture)
        .init();
}
