//! `publisher.nats.declare_stream` (development): a JetStream stream the relay creates, when
//! it does not exist, at start and after every reconnect, capturing the subjects its subject
//! templates render, so that a machine without the `nats` CLI can take the relay's messages.
//! A stream of that name that exists is left as it is.

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::ErrorCode;
use async_nats::jetstream::context::{CreateStreamErrorKind, GetStreamErrorKind};
use async_nats::jetstream::stream::{Config, StorageType};

use super::window::required_window;
use crate::config::nats::filter_of;
use crate::template::Template;

/// The stream's duplicate window when the lease asks for less: JetStream's default.
const DEFAULT_WINDOW: Duration = Duration::from_secs(120);

/// The stream to create and what it captures.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamDeclaration {
    /// The stream's name (`publisher.nats.declare_stream`).
    pub name: String,
    /// The subject filters it captures: see [`subject_filters`].
    pub subjects: Vec<String>,
    /// Its duplicate window: twice the lease, at least JetStream's default of 2 minutes.
    pub duplicate_window: Duration,
}

/// What [`StreamDeclaration::declare`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Declared {
    /// The stream was created now.
    Created,
    /// A stream of that name was there already (its subjects as it has them).
    Existed(Vec<String>),
}

impl StreamDeclaration {
    /// The declaration of stream `name` for `templates` and the relay's `lease`.
    pub fn new(name: &str, templates: &[Template], lease: Duration) -> Self {
        Self {
            name: name.to_owned(),
            subjects: subject_filters(templates),
            duplicate_window: required_window(lease).max(DEFAULT_WINDOW),
        }
    }

    /// Creates the stream unless one of its name exists. The error is a sentence naming the
    /// key.
    pub async fn declare(&self, js: &Context) -> Result<Declared, String> {
        match js.get_stream(&self.name).await {
            Ok(stream) => {
                let subjects = stream.cached_info().config.subjects.clone();
                return Ok(Declared::Existed(subjects));
            }
            Err(e) => match e.kind() {
                GetStreamErrorKind::JetStream(j)
                    if j.error_code() == ErrorCode::STREAM_NOT_FOUND => {}
                _ => return Err(self.failed(&e)),
            },
        }
        let config = Config {
            name: self.name.clone(),
            subjects: self.subjects.clone(),
            storage: StorageType::File,
            duplicate_window: self.duplicate_window,
            ..Config::default()
        };
        match js.create_stream(config).await {
            Ok(_) => Ok(Declared::Created),
            // Another relay created it in between.
            Err(e) if matches!(e.kind(), CreateStreamErrorKind::JetStream(j) if j.error_code() == ErrorCode::STREAM_NAME_EXIST) => {
                Ok(Declared::Existed(self.subjects.clone()))
            }
            Err(e) => Err(self.failed(&e)),
        }
    }

    /// The sentence for a failed declaration.
    fn failed(&self, e: &dyn std::fmt::Display) -> String {
        format!(
            "cannot create JetStream stream {:?} capturing {:?} (publisher.nats.declare_stream): {e}; if another stream already captures these subjects, remove the key",
            self.name, self.subjects
        )
    }

    /// The line `run` logs about the stream.
    pub fn describe(&self, declared: &Declared) -> String {
        match declared {
            Declared::Created => format!(
                "created JetStream stream {:?} capturing {:?} (file storage, duplicate window {}; publisher.nats.declare_stream, development)",
                self.name,
                self.subjects,
                humantime::format_duration(self.duplicate_window)
            ),
            Declared::Existed(subjects) => format!(
                "JetStream stream {:?} exists, capturing {subjects:?}; left as it is (publisher.nats.declare_stream)",
                self.name
            ),
        }
    }
}

/// The subject filters covering every subject `templates` render (see [`filter_of`]), without
/// repeats and without a filter another one covers (a stream refuses overlapping subjects).
pub fn subject_filters(templates: &[Template]) -> Vec<String> {
    let mut filters: Vec<String> = templates.iter().map(filter_of).collect();
    filters.sort();
    filters.dedup();
    let covered = |f: &str, by: &str| {
        f != by
            && (by == ">"
                || by
                    .strip_suffix('>')
                    .is_some_and(|head| head.ends_with('.') && f.starts_with(head)))
    };
    let kept: Vec<String> = filters
        .iter()
        .filter(|f| !filters.iter().any(|by| covered(f, by)))
        .cloned()
        .collect();
    kept
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filters(templates: &[&str]) -> Vec<String> {
        let t: Vec<Template> = templates
            .iter()
            .map(|t| Template::parse(t).unwrap())
            .collect();
        subject_filters(&t)
    }

    #[test]
    fn filters_are_the_fixed_tokens_then_a_tail_wildcard_without_overlaps() {
        assert_eq!(
            filters(&["outbox.{aggregate_type}.{event_type}"]),
            ["outbox.>"]
        );
        assert_eq!(filters(&["orders.created"]), ["orders.created"]);
        assert_eq!(
            filters(&[
                "outbox.{aggregate_type}",
                "outbox.billing.{event_type}",
                "outbox.fixed",
                "billing.{event_type}",
                "outbox.{aggregate_id}",
            ]),
            ["billing.>", "outbox.>"]
        );
        // "outboxes.x" is not under "outbox.>".
        assert_eq!(
            filters(&["outbox.{event_type}", "outboxes.x"]),
            ["outbox.>", "outboxes.x"]
        );
    }

    #[test]
    fn the_window_covers_twice_the_lease_and_never_less_than_the_default() {
        let t = [Template::parse("a.{event_type}").unwrap()];
        let short = StreamDeclaration::new("S", &t, Duration::from_secs(10));
        assert_eq!(short.duplicate_window, Duration::from_secs(120));
        let long = StreamDeclaration::new("S", &t, Duration::from_secs(300));
        assert_eq!(long.duplicate_window, Duration::from_secs(600));
        assert!(
            long.describe(&Declared::Created)
                .contains("created JetStream stream \"S\" capturing [\"a.>\"]")
        );
    }
}
