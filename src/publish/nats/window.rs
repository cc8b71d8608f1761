//! The streams' duplicate windows against `relay.lease_timeout`: "no duplicates after a crash"
//! holds only while a republished message still falls inside the window of the stream that
//! stored the first copy. A row published just before its relay died is published again once
//! its lease ran out and the lease task (every `lease_timeout / 3`, at most 20 s) handed it
//! back, so the window must cover the lease and more: the relay asks for twice the lease.
//!
//! Checked when the relay first connects (`run` logs a warning, `check` prints it): the
//! streams whose subjects overlap the subjects each subject template can render (a row's
//! `destination` cannot be known in advance and is not checked).

use std::time::Duration;

use async_nats::jetstream::Context;

use crate::config::nats::filter_of;
use crate::template::Template;

/// The shortest duplicate window the relay accepts without a warning for `lease`.
pub fn required_window(lease: Duration) -> Duration {
    lease.saturating_mul(2)
}

/// What the relay needs from the streams it publishes to.
#[derive(Debug, Clone)]
pub struct WindowAudit {
    /// `relay.lease_timeout`.
    pub lease: Duration,
    /// The subject templates in use (the publisher's and each outbox's own), deduplicated.
    pub templates: Vec<Template>,
}

impl WindowAudit {
    /// The warnings for the streams that capture the templates' subjects on the server behind
    /// `js`: a window shorter than [`required_window`], or no stream at all. A server that
    /// will not list its streams (permissions) gives none: the audit is advice.
    pub async fn warnings(&self, js: &Context) -> Vec<String> {
        let mut out = Vec::new();
        let want = required_window(self.lease);
        for template in &self.templates {
            let filter = filter_of(template);
            let Some(names) = stream_names(js, &filter).await else {
                continue;
            };
            if names.is_empty() {
                out.push(format!(
                    "no JetStream stream captures subjects under {filter:?} (publisher.nats.subject {:?}): publishes to them fail until one does",
                    template.as_str()
                ));
            }
            for name in names {
                let Ok(stream) = js.get_stream(&name).await else {
                    continue;
                };
                let window = stream.cached_info().config.duplicate_window;
                if window < want {
                    out.push(short_window(&name, window, self.lease, want));
                }
            }
        }
        out.sort();
        out.dedup();
        out
    }
}

/// The warning for stream `name` whose window is `window`.
fn short_window(name: &str, window: Duration, lease: Duration, want: Duration) -> String {
    let show = |d: Duration| humantime::format_duration(d).to_string();
    format!(
        "stream {name:?} has a duplicate window of {} but relay.lease_timeout is {}: a message republished after a relay died can be stored twice; set the stream's duplicate_window to at least {} (`nats stream edit {name} --dupe-window {}`) or lower relay.lease_timeout",
        show(window),
        show(lease),
        show(want),
        show(want).replace(' ', ""),
    )
}

/// The streams whose subjects overlap `filter` (`$JS.API.STREAM.NAMES`), or `None` when the
/// server does not say.
async fn stream_names(js: &Context, filter: &str) -> Option<Vec<String>> {
    let request = serde_json::json!({ "subject": filter });
    let reply: serde_json::Value = match js.request("STREAM.NAMES", &request).await {
        Ok(reply) => reply,
        Err(e) => {
            tracing::debug!(error = %e, filter, "cannot list the JetStream streams");
            return None;
        }
    };
    if reply.get("error").is_some() {
        tracing::debug!(reply = %reply, filter, "cannot list the JetStream streams");
        return None;
    }
    let names = reply.get("streams").and_then(|s| s.as_array());
    Some(
        names
            .into_iter()
            .flatten()
            .filter_map(|n| n.as_str().map(str::to_owned))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_warning_names_both_values_and_what_to_set() {
        let lease = Duration::from_secs(60);
        let w = short_window(
            "OUTBOX",
            Duration::from_secs(30),
            lease,
            required_window(lease),
        );
        for part in [
            "\"OUTBOX\"",
            "duplicate window of 30s",
            "relay.lease_timeout is 1m",
            "at least 2m",
            "--dupe-window 2m",
        ] {
            assert!(w.contains(part), "{part}: {w}");
        }
    }
}
