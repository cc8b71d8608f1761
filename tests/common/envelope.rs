//! The docs/wire-format.md checks of a message against the row it carries, shared by the
//! scenarios that check the envelope (`delivery.rs` on RabbitMQ and Kafka, `both_databases.rs`
//! on PostgreSQL and MySQL outboxes).

use std::collections::BTreeMap;
use std::fmt::Debug;

use lapin::types::ShortString;
use serde_json::Value;

use super::{Delivered, RowState, expected_row_headers, time_problem};

/// The content type of a JSON payload.
pub const JSON: &str = "application/json";

/// A message as either broker carries it, for [`envelope_problems`].
pub struct Message<'a> {
    /// What the CloudEvents attribute headers are named with (`cloudEvents:`, `ce_`).
    pub prefix: &'a str,
    /// The headers in wire order, `None` for one without a value.
    pub headers: Vec<(String, Option<String>)>,
    /// The headers the binding adds besides the CloudEvents attributes, with their values.
    pub fixed: &'a [(&'a str, &'a str)],
    /// The message's body.
    pub body: &'a [u8],
}

/// Adds `name got != want` to `problems` unless `got` is `want`.
pub fn expect<T: PartialEq + Debug>(problems: &mut Vec<String>, name: &str, got: T, want: T) {
    if got != want {
        problems.push(format!("{name} {got:?} != {want:?}"));
    }
}

/// The docs/wire-format.md checks of `message` against `row` that both brokers share: each header
/// once and with a value; the CloudEvents attributes (the prefix's headers) with the row's
/// values and `source`; the fixed headers with theirs; the other headers without the prefix
/// exactly the row's headers; the body the row's JSON payload. Returns the problems found.
pub fn envelope_problems(message: Message, row: &RowState, source: &str) -> Vec<String> {
    let mut problems = Vec::new();
    let mut headers = BTreeMap::new();
    for (name, value) in message.headers {
        let Some(value) = value else {
            problems.push(format!("header {name} without a value"));
            continue;
        };
        if headers.insert(name.clone(), value).is_some() {
            problems.push(format!("repeated header {name}"));
        }
    }
    let prefix = message.prefix;
    let id = row.id.to_string();
    for (attribute, want) in [
        ("id", Some(id.as_str())),
        ("type", Some(row.event_type.as_str())),
        ("source", Some(source)),
        ("specversion", Some("1.0")),
        ("aggregatetype", Some(row.aggregate_type.as_str())),
        ("subject", row.aggregate_id.as_deref()),
    ] {
        let name = format!("{prefix}{attribute}");
        expect(&mut problems, &name, headers.remove(&name).as_deref(), want);
    }
    let time = format!("{prefix}time");
    let time_value = headers.remove(&time);
    problems.extend(time_problem(&time, time_value.as_deref(), row.created_at));
    for (name, value) in message.fixed {
        let got = headers.remove(*name);
        expect(&mut problems, name, got.as_deref(), Some(*value));
    }
    headers.retain(|name, _| !name.starts_with(prefix));
    let expected = expected_row_headers(&row.headers);
    if headers != expected {
        problems.push(format!("row headers {headers:?} != expected {expected:?}"));
    }
    match serde_json::from_slice::<Value>(message.body) {
        Ok(body) if body == row.payload => {}
        Ok(body) => problems.push(format!("body {body} != payload {}", row.payload)),
        Err(e) => problems.push(format!("body is not JSON: {e}")),
    }
    problems
}

/// [`envelope_problems`] of a RabbitMQ delivery (the CloudEvents attributes named with
/// `prefix`), and of its AMQP properties and routing key.
pub fn amqp_problems(d: &Delivered, row: &RowState, source: &str, prefix: &str) -> Vec<String> {
    let headers = d.headers().into_iter().map(|(k, v)| (k, Some(v))).collect();
    let message = Message {
        prefix,
        headers,
        fixed: &[],
        body: &d.body,
    };
    let mut problems = envelope_problems(message, row, source);
    let props = &d.properties;
    let kind = props.kind().as_ref().map(ShortString::as_str);
    let content_type = props.content_type().as_ref().map(ShortString::as_str);
    let created = u64::try_from(row.created_at.timestamp()).unwrap();
    let route = format!("{}.{}", row.aggregate_type, row.event_type);
    let found = &mut problems;
    expect(found, "type", kind, Some(row.event_type.as_str()));
    expect(found, "timestamp", *props.timestamp(), Some(created));
    expect(found, "content_type", content_type, Some(JSON));
    expect(found, "delivery_mode", *props.delivery_mode(), Some(2));
    expect(found, "routing key", &d.routing_key, &route);
    problems
}
