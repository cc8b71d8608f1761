//! OpenTelemetry traces (docs/tracing.md) over the real wire: the
//! relay binary exports OTLP (HTTP/protobuf, or gRPC) to the test kit's receiver
//! (`otlp::OtlpReceiver`, decoded with `opentelemetry-proto`), and the consumers on RabbitMQ,
//! Kafka, NATS JetStream (a message header) and Redis Streams (the entry's `headers` field),
//! and the webhook endpoint, read the `traceparent` each message carries. Span and trace ids
//! are checked against the row's `traceparent` and against what the consumer received; a row
//! whose first attempt fails (unroutable on RabbitMQ, no stream for its subject on NATS,
//! `WRONGTYPE` on Redis) has two spans in its trace, the first with error status.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::kafka::Record;
use common::nats::{NATS_URL, NatsStream, nats_relay};
use common::otlp::{KIND_PRODUCER, OtlpReceiver, Protocol, ReceivedSpan, STATUS_ERROR};
use common::transport::{Sink, Transport};
use common::webhook::{Endpoint, Reply};
use common::{
    NewRow, REDIS_URL, RedisStreams, RelayBuilder, RelayProcess, TestTable, free_port, redis_relay,
    sample, scrape, spawn_paced_writer, table_and_exchange, wait_for_sample, wait_until,
};
use serde_json::json;
use uuid::Uuid;

/// How long a message, a row state or a span may take to show up.
const WAIT: Duration = Duration::from_secs(30);

/// A sampled W3C context as an application's instrumentation writes it into the row.
const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

fn traceparent(flags: &str) -> String {
    format!("00-{TRACE}-{PARENT_SPAN}-{flags}")
}

/// `builder` exporting to `receiver` (in the protocol it speaks) every 200 ms (the batch
/// processor's delay).
fn traced(builder: RelayBuilder, receiver: &OtlpReceiver) -> RelayBuilder {
    builder
        .set("tracing.otlp_endpoint", receiver.endpoint())
        .set("tracing.protocol", receiver.protocol().config_value())
        .set("tracing.service_name", "relay-under-test")
        .env("OTEL_BSP_SCHEDULE_DELAY", "200")
}

/// The headers a message arrived with, on either broker.
async fn received_headers(sink: &Sink, id: Uuid) -> BTreeMap<String, String> {
    match sink {
        Sink::RabbitMq(rabbit) => rabbit.wait_for_delivery(id, WAIT).await.headers(),
        Sink::Kafka { consumer, .. } => {
            let record: Record = wait_until(WAIT, "the record reaches the consumer", async || {
                let records = consumer.records();
                let found = records.into_iter().find(|r| r.id() == Some(id));
                found.ok_or_else(|| "not yet".to_owned())
            })
            .await;
            let headers = record.headers.into_iter();
            headers.filter_map(|(k, v)| Some((k, v?))).collect()
        }
        Sink::Http(_) => unreachable!("the webhook is Target::Webhook"),
    }
}

/// Where a traced relay publishes: a broker, or the webhook endpoint (answering 200).
enum Target {
    Broker(Sink),
    Webhook(Endpoint),
    /// The test's stream, capturing `<prefix>.>`; subjects `<prefix>.{aggregate_type}.{event_type}`.
    Nats(NatsStream),
    /// The test's stream keys `<prefix>.{aggregate_type}`.
    Redis(RedisStreams),
}

/// The aggregate type whose messages [`Target::parking`] makes fail until
/// [`Target::unpark`].
const PARKED: &str = "parked";

/// A broker on which a message can be made to fail at first ([`Target::parking`]).
#[derive(Debug, Clone, Copy)]
enum Parking {
    RabbitMq,
    Nats,
    Redis,
}

impl Target {
    /// `test`'s exchange or topic on `transport`, for rows of type `order`.
    async fn broker(transport: Transport, test: &str) -> Self {
        Self::Broker(Sink::new(transport, test, "#", &["order"]).await)
    }

    async fn webhook() -> Self {
        Self::Webhook(Endpoint::start(|_| Reply::status(200)).await)
    }

    async fn nats(test: &str) -> Self {
        Self::Nats(NatsStream::new(test).await)
    }

    async fn redis(test: &str) -> Self {
        Self::Redis(RedisStreams::new(test).await)
    }

    /// `test`'s destination on `broker`, refusing the messages of [`PARKED`] rows (a
    /// message-level failure) until [`Target::unpark`]: on RabbitMQ their routing key is
    /// unroutable (the queue is bound to `ok.#` only), on NATS no stream captures their subject,
    /// on Redis their stream key holds a string (`WRONGTYPE`).
    async fn parking(broker: Parking, test: &str) -> Self {
        match broker {
            Parking::RabbitMq => {
                Self::Broker(Sink::new(Transport::RabbitMq, test, "ok.#", &[]).await)
            }
            Parking::Nats => {
                let stream = NatsStream::new(test).await;
                stream
                    .set_subjects(&[format!("{}.ok.>", stream.prefix)])
                    .await;
                Self::Nats(stream)
            }
            Parking::Redis => {
                let streams = RedisStreams::new(test).await;
                let key = streams.key(PARKED);
                let _: () = redis::AsyncCommands::set(&mut streams.conn(), &key, "not a stream")
                    .await
                    .unwrap();
                Self::Redis(streams)
            }
        }
    }

    /// Lets [`PARKED`] messages through from now on.
    async fn unpark(&self) {
        match self {
            Self::Broker(Sink::RabbitMq(rabbit)) => rabbit.bind(&format!("{PARKED}.#")).await,
            Self::Nats(stream) => stream.set_subjects(&[format!("{}.>", stream.prefix)]).await,
            Self::Redis(streams) => {
                let key = streams.key(PARKED);
                let _: () = redis::AsyncCommands::del(&mut streams.conn(), &key)
                    .await
                    .unwrap();
            }
            Self::Broker(Sink::Kafka { .. } | Sink::Http(_)) | Self::Webhook(_) => {
                unreachable!("never parked")
            }
        }
    }

    /// Words of which the error status of a refused [`PARKED`] message holds one.
    fn refusal(&self) -> &'static [&'static str] {
        match self {
            Self::Broker(Sink::RabbitMq(_)) => &["unroutable", "NO_ROUTE"],
            Self::Nats(_) => &["no JetStream stream captures"],
            Self::Redis(_) => &["WRONGTYPE"],
            Self::Broker(Sink::Kafka { .. } | Sink::Http(_)) | Self::Webhook(_) => &[],
        }
    }

    fn relay(&self, table: &TestTable, instance: &str) -> RelayBuilder {
        match self {
            Self::Broker(sink) => sink.relay(table, instance),
            Self::Webhook(endpoint) => RelayBuilder::for_table(table, instance)
                .set("publisher.kind", "http")
                .set(
                    "publisher.http.url",
                    endpoint.url("/hooks/{aggregate_type}?token=t"),
                ),
            Self::Nats(stream) => nats_relay(table, stream, NATS_URL, instance),
            Self::Redis(streams) => redis_relay(table, REDIS_URL, &streams.template(), instance),
        }
    }

    /// `messaging.system` and `messaging.destination.name` of its spans.
    fn system_and_destination(&self) -> (&'static str, String) {
        match self {
            Self::Broker(Sink::RabbitMq(rabbit)) => ("rabbitmq", rabbit.exchange.clone()),
            Self::Broker(Sink::Kafka { topics, .. }) => ("kafka", topics[0].clone()),
            Self::Broker(Sink::Http(_)) => unreachable!("the webhook is Target::Webhook"),
            Self::Webhook(_) => ("http", "127.0.0.1/hooks/order".to_owned()),
            Self::Nats(stream) => ("nats", format!("{}.order.created", stream.prefix)),
            Self::Redis(streams) => ("redis", streams.key("order")),
        }
    }

    /// The headers message `id` arrived with (a webhook's, names lower-cased; a Redis entry's
    /// `headers` field).
    async fn received_headers(&self, id: Uuid) -> BTreeMap<String, String> {
        let id_text = id.to_string();
        match self {
            Self::Broker(sink) => received_headers(sink, id).await,
            Self::Nats(stream) => {
                let message = wait_until(WAIT, "the message reaches the stream", async || {
                    let mut messages = stream.messages().await.into_iter();
                    let found = messages.find(|m| m.id() == id_text);
                    found.ok_or_else(|| "not yet".to_owned())
                })
                .await;
                message.headers
            }
            Self::Redis(streams) => {
                let entry = wait_until(WAIT, "the entry reaches the stream", async || {
                    let all = streams.all_entries().await;
                    let mut entries = all.into_values().flatten();
                    let found = entries.find(|e| e.field("id").as_ref() == Some(&id_text));
                    found.ok_or_else(|| "not yet".to_owned())
                })
                .await;
                let headers = entry.field("headers").expect("a headers field");
                serde_json::from_str(&headers).expect("the headers field is a JSON object")
            }
            Self::Webhook(endpoint) => {
                let id = id.to_string();
                let request = wait_until(WAIT, "the request reaches the endpoint", async || {
                    let mut requests = endpoint.messages().into_iter();
                    let found = requests.find(|r| r.id().as_ref() == Some(&id));
                    found.ok_or_else(|| "not yet".to_owned())
                })
                .await;
                request.headers.into_iter().collect()
            }
        }
    }

    async fn finish(self, relay: RelayProcess, table: TestTable) {
        match self {
            Self::Broker(sink) => sink.finish(relay, table).await,
            Self::Webhook(_) => common::finish_with(relay, table, async {}).await,
            Self::Nats(stream) => common::finish_with(relay, table, stream.teardown()).await,
            Self::Redis(streams) => common::finish_with(relay, table, streams.teardown()).await,
        }
    }
}

/// The one span of `id`'s first attempt.
async fn span_of(receiver: &OtlpReceiver, id: Uuid) -> ReceivedSpan {
    let spans = receiver
        .wait_for_spans_with("messaging.message.id", &id.to_string(), 1, WAIT)
        .await;
    assert_eq!(spans.len(), 1, "{spans:#?}");
    spans.into_iter().next().unwrap()
}

/// Three rows (a sampled context, none, an unparsable one) relayed to `target` with spans
/// exported over `protocol`: each span's ids and attributes, and the context each message carries.
async fn continues_the_rows_trace(target: Target, protocol: Protocol, test: &str) {
    let receiver = OtlpReceiver::start_speaking(protocol).await;
    let table = TestTable::new(test).await;
    let relay = traced(target.relay(&table, test), &receiver).spawn();

    let with_context = NewRow::new("order", Some("o-1"), "created", json!({"n": 1})).headers(
        json!({"traceparent": traceparent("01"), "tracestate": "vendor=abc", "tenant": "t1"}),
    );
    let without = NewRow::new("order", Some("o-2"), "created", json!({"n": 2}));
    let garbled = NewRow::new("order", Some("o-3"), "created", json!({"n": 3}))
        .headers(json!({"traceparent": "not-a-traceparent"}));
    let ids = table.insert_ids(&[with_context, without, garbled]).await;
    table.wait_all_sent(WAIT).await;

    // The row's context is the span's parent; the consumer gets the span's context.
    let span = span_of(&receiver, ids[0]).await;
    assert_eq!(
        (span.trace_id.as_str(), span.parent_span_id.as_str()),
        (TRACE, PARENT_SPAN)
    );
    assert_eq!(span.kind, KIND_PRODUCER);
    assert_eq!(span.status_code, 0, "{span:?}");
    assert_eq!(span.service_name, "relay-under-test");
    let (system, destination) = target.system_and_destination();
    assert_eq!(span.name, format!("publish {destination}"));
    assert_eq!(span.attr("messaging.system"), system);
    assert_eq!(span.attr("messaging.destination.name"), destination);
    assert_eq!(span.attr("outbox.name"), table.name);
    assert_eq!(span.attr("outbox.aggregate_type"), "order");
    assert_eq!(span.attr("outbox.attempt"), "1");
    let queued: f64 = span.attr("outbox.queued_seconds").parse().unwrap();
    assert!((0.0..30.0).contains(&queued), "{queued}");
    let headers = target.received_headers(ids[0]).await;
    assert_eq!(headers["traceparent"], span.traceparent());
    assert_eq!(headers["tracestate"], "vendor=abc");
    assert_eq!(headers["tenant"], "t1");

    // No context: the span starts a trace, and the message carries it.
    let root = span_of(&receiver, ids[1]).await;
    assert!(
        root.parent_span_id.is_empty() && root.trace_id != TRACE,
        "{root:?}"
    );
    let headers = target.received_headers(ids[1]).await;
    assert_eq!(headers["traceparent"], root.traceparent());

    // An unparsable context: a trace of its own, the header passed through as written.
    let fresh = span_of(&receiver, ids[2]).await;
    assert!(fresh.parent_span_id.is_empty(), "{fresh:?}");
    let headers = target.received_headers(ids[2]).await;
    assert_eq!(headers["traceparent"], "not-a-traceparent");

    target.finish(relay, table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rabbitmq_messages_continue_the_rows_trace() {
    let target = Target::broker(Transport::RabbitMq, "trace_rabbit").await;
    continues_the_rows_trace(target, Protocol::HttpProtobuf, "trace_rabbit").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kafka_messages_continue_the_rows_trace() {
    let target = Target::broker(Transport::Kafka, "trace_kafka").await;
    continues_the_rows_trace(target, Protocol::HttpProtobuf, "trace_kafka").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_messages_continue_the_rows_trace() {
    let target = Target::nats("trace_nats").await;
    continues_the_rows_trace(target, Protocol::HttpProtobuf, "trace_nats").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_entries_continue_the_rows_trace() {
    let target = Target::redis("trace_redis").await;
    continues_the_rows_trace(target, Protocol::HttpProtobuf, "trace_redis").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_requests_continue_the_rows_trace() {
    let target = Target::webhook().await;
    continues_the_rows_trace(target, Protocol::HttpProtobuf, "trace_webhook").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_a_grpc_collector() {
    let target = Target::broker(Transport::RabbitMq, "trace_grpc").await;
    continues_the_rows_trace(target, Protocol::Grpc, "trace_grpc").await;
}

/// A [`PARKED`] row whose first attempt `target` refuses (see [`Target::parking`]), let
/// through before the second: two spans in the row's trace, the first with error status, and
/// the message carries the second's context.
async fn a_retried_row_has_two_spans_in_its_trace(broker: Parking, test: &str) {
    let receiver = OtlpReceiver::start().await;
    let table = TestTable::new(test).await;
    let target = Target::parking(broker, test).await;
    // 1 s between the attempts: time for the test to see the failure and unpark.
    let relay = traced(target.relay(&table, test), &receiver)
        .set("retry.base_delay", "1s")
        .set("retry.jitter", "0")
        .spawn();
    let row = NewRow::new(PARKED, Some("p-1"), "created", json!({}))
        .headers(json!({"traceparent": traceparent("01")}));
    let id = table.insert_one(row).await;
    let failed = table
        .wait_row(id, WAIT, "the first attempt failed", |r| {
            r.attempts >= 1 && r.status == "pending"
        })
        .await;
    assert!(failed.last_error.is_some(), "{failed:?}");
    target.unpark().await;
    table.wait_all_sent(WAIT).await;

    let mut spans = receiver
        .wait_for_spans_with("messaging.message.id", &id.to_string(), 2, WAIT)
        .await;
    spans.sort_by_key(|s| s.attr("outbox.attempt").to_owned());
    let [first, second] = &spans[..] else {
        panic!("{spans:#?}")
    };
    for span in [first, second] {
        assert_eq!(
            (span.trace_id.as_str(), span.parent_span_id.as_str()),
            (TRACE, PARENT_SPAN),
            "every attempt is a child of the row's context"
        );
    }
    assert_eq!(
        (first.attr("outbox.attempt"), second.attr("outbox.attempt")),
        ("1", "2")
    );
    assert_eq!(first.status_code, STATUS_ERROR, "{first:?}");
    assert!(
        target
            .refusal()
            .iter()
            .any(|word| first.status_message.contains(word)),
        "{first:?}"
    );
    assert_eq!(second.status_code, 0, "{second:?}");
    let headers = target.received_headers(id).await;
    assert_eq!(headers["traceparent"], second.traceparent());
    target.finish(relay, table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_row_has_a_span_per_attempt_in_its_trace() {
    a_retried_row_has_two_spans_in_its_trace(Parking::RabbitMq, "trace_retry").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_nats_message_has_a_span_per_attempt_in_its_trace() {
    a_retried_row_has_two_spans_in_its_trace(Parking::Nats, "trace_nats_retry").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_redis_entry_has_a_span_per_attempt_in_its_trace() {
    a_retried_row_has_two_spans_in_its_trace(Parking::Redis, "trace_redis_retry").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unsampled_context_records_nothing_but_propagates() {
    let receiver = OtlpReceiver::start().await;
    let (table, rabbit) = table_and_exchange("trace_unsampled").await;
    // Configured by the standard variables alone.
    let relay = RelayBuilder::for_test(&table, &rabbit, "trace_unsampled")
        .env("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint())
        .env("OTEL_SERVICE_NAME", "from-otel-env")
        .env("OTEL_BSP_SCHEDULE_DELAY", "200")
        .spawn();
    let unsampled = NewRow::new("order", Some("u-1"), "created", json!({}))
        .headers(json!({"traceparent": traceparent("00")}));
    let id = table.insert_one(unsampled).await;
    let headers = rabbit.wait_for_delivery(id, WAIT).await.headers();
    let tp = &headers["traceparent"];
    let parts: Vec<&str> = tp.split('-').collect();
    assert_eq!(parts.len(), 4, "{tp}");
    assert_eq!((parts[0], parts[1], parts[3]), ("00", TRACE, "00"), "{tp}");
    assert_ne!(
        parts[2], PARENT_SPAN,
        "the relay's span, not the row's: {tp}"
    );

    // A sampled row published after it: once its span arrived, the unsampled one would have.
    let marker = table
        .insert_one(NewRow::new("order", Some("u-2"), "created", json!({})))
        .await;
    let marker_span = span_of(&receiver, marker).await;
    assert_eq!(marker_span.service_name, "from-otel-env");
    assert!(
        receiver
            .spans_with("messaging.message.id", &id.to_string())
            .is_empty()
    );
    assert!(receiver.spans().iter().all(|s| s.trace_id != TRACE));
    common::finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tracing_off_leaves_the_rows_headers_as_they_are() {
    let (table, rabbit) = table_and_exchange("trace_off").await;
    let relay = RelayBuilder::for_test(&table, &rabbit, "trace_off").spawn();
    let row_headers = json!({"traceparent": traceparent("01"), "tracestate": "vendor=abc", "n": 1});
    let id = table
        .insert_one(
            NewRow::new("order", Some("x"), "created", json!({})).headers(row_headers.clone()),
        )
        .await;
    let headers = rabbit.wait_for_delivery(id, WAIT).await.headers();
    let row: BTreeMap<String, String> = common::expected_row_headers(&row_headers);
    let sent: BTreeMap<String, String> = headers
        .into_iter()
        .filter(|(k, _)| !k.starts_with("cloudEvents:"))
        .collect();
    assert_eq!(sent, row);
    common::finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_down_during_a_drain_loses_no_row() {
    let mut receiver = OtlpReceiver::start().await;
    let (table, rabbit) = table_and_exchange("trace_collector_down").await;
    let metrics = free_port();
    let relay = traced(
        RelayBuilder::for_test(&table, &rabbit, "trace_down"),
        &receiver,
    )
    .set("metrics.listen", format!("127.0.0.1:{metrics}"))
    .spawn();
    let first = table
        .insert_one(NewRow::new("order", Some("d-0"), "created", json!({})))
        .await;
    span_of(&receiver, first).await;

    // The collector goes away for 10 s while rows keep coming.
    receiver.stop().await;
    let writer = spawn_paced_writer(&table.name, 20, 100, Duration::from_millis(500), |r, i| {
        NewRow::new(
            "order",
            Some(&format!("d-{}", i % 20)),
            "created",
            json!({"r": r, "i": i}),
        )
    });
    let dropped = wait_for_sample(
        metrics,
        WAIT,
        "outbox_trace_spans_dropped_total",
        &[("reason", "export_failed")],
        |v| v > 0.0,
    )
    .await;
    assert!(dropped > 0.0);
    tokio::time::sleep(Duration::from_secs(10)).await;
    receiver.restart().await;
    let ids = writer.await.unwrap();
    assert_eq!(ids.len(), 2000);
    rabbit.wait_for_ids(&ids, WAIT).await;
    table.wait_all_sent(WAIT).await;
    assert_eq!(
        relay.log_count("trace spans are being dropped"),
        1,
        "one warning for the whole outage"
    );
    assert_eq!(
        relay.log_count("the collector does not accept connections"),
        1,
        "the warning says why in words"
    );
    assert_eq!(
        relay.log_count("reqwest::Error"),
        0,
        "no client's debug dump"
    );

    // Export works again.
    let after = table
        .insert_one(NewRow::new("order", Some("d-after"), "created", json!({})))
        .await;
    span_of(&receiver, after).await;
    let text = scrape(metrics).await.unwrap();
    let failed = sample(
        &text,
        "outbox_trace_spans_dropped_total",
        &[("reason", "export_failed")],
    );
    assert!(failed.unwrap_or(0.0) >= dropped);
    relay
        .wait_for_log("trace export works again", 1, WAIT)
        .await;
    common::finish(relay, table, rabbit).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn check_says_where_spans_go_and_warns_when_the_collector_does_not_take_them() {
    let mut receiver = OtlpReceiver::start().await;
    let (table, rabbit) = table_and_exchange("trace_check").await;
    let endpoint = receiver.endpoint();
    let builder = || {
        RelayBuilder::for_test(&table, &rabbit, "trace_check")
            .set("tracing.otlp_endpoint", endpoint.clone())
            .set("tracing.service_name", "relay-under-test")
    };
    let out = builder().output(&["check"], WAIT).await;
    assert!(out.status.success(), "{out:?}");
    out.assert_stdout_has(&format!(
        "tracing: ok (http/protobuf to {endpoint}/v1/traces, service relay-under-test"
    ));

    // The standard traces variable is the whole URL: a wrong path is answered 404.
    let out = RelayBuilder::for_test(&table, &rabbit, "trace_check")
        .env(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            format!("{endpoint}/not-traces"),
        )
        .output(&["check"], WAIT)
        .await;
    assert!(
        out.status.success(),
        "tracing is not a reason to fail: {out:?}"
    );
    out.assert_stdout_has("tracing: WARNING: the collector answers 404");

    receiver.stop().await;
    let out = builder().output(&["check"], WAIT).await;
    assert!(
        out.status.success(),
        "tracing is not a reason to fail: {out:?}"
    );
    out.assert_stdout_has("tracing: WARNING: the collector does not answer");

    let out = RelayBuilder::for_test(&table, &rabbit, "trace_check")
        .output(&["check"], WAIT)
        .await;
    out.assert_stdout_has("tracing: off");
    common::drop_both(table, rabbit).await;
}
