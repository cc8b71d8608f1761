//! `[tracing]`: where OpenTelemetry spans go (docs/tracing.md). Off unless `otlp_endpoint` or one
//! of the standard `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` and `OTEL_EXPORTER_OTLP_ENDPOINT` is set;
//! the relay's own keys win over the standard `OTEL_*` variables, which fill in what the file and
//! `RELAY_TRACING__*` leave unset (the traces-only variable before the general one, as the
//! OpenTelemetry SDKs read them).

use serde::{Deserialize, Serialize};

use super::{ConfigError, choose};

/// The standard variable naming the collector (the OTLP base URL).
pub const OTEL_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The standard variable naming where traces go: over HTTP the full URL, used as written.
pub const OTEL_TRACES_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
/// The standard variable naming the service.
pub const OTEL_SERVICE_NAME_ENV: &str = "OTEL_SERVICE_NAME";
/// The standard variable naming the OTLP protocol.
pub const OTEL_PROTOCOL_ENV: &str = "OTEL_EXPORTER_OTLP_PROTOCOL";
/// The standard variable naming the OTLP protocol for traces alone.
pub const OTEL_TRACES_PROTOCOL_ENV: &str = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL";
/// `service.name` when neither `tracing.service_name` nor `OTEL_SERVICE_NAME` is set.
pub const DEFAULT_SERVICE_NAME: &str = "outbox-relay";

/// `[tracing]` as written.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawTracing {
    /// The collector's OTLP base URL, e.g. `http://127.0.0.1:4318` (default: none, tracing off;
    /// env `OTEL_EXPORTER_OTLP_ENDPOINT` when unset). HTTP/protobuf posts to
    /// `<endpoint>/v1/traces`; gRPC connects to the endpoint itself.
    pub otlp_endpoint: Option<String>,
    /// `"http/protobuf"` (default) or `"grpc"` (env `OTEL_EXPORTER_OTLP_PROTOCOL` when unset).
    pub protocol: Option<String>,
    /// `service.name` of the spans (default `outbox-relay`; env `OTEL_SERVICE_NAME` when unset).
    pub service_name: Option<String>,
    /// Share of the traces the relay starts (rows without a `traceparent`) that are recorded,
    /// 0.0 to 1.0 (default 1.0). Rows with a context follow its sampled flag.
    pub sample_ratio: Option<f64>,
}

/// The standard `OTEL_*` variables that `[tracing]` honours, read once at load.
#[derive(Debug, Clone, Default)]
pub struct OtelEnv {
    /// `OTEL_EXPORTER_OTLP_ENDPOINT`
    pub endpoint: Option<String>,
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`
    pub traces_endpoint: Option<String>,
    /// `OTEL_SERVICE_NAME`
    pub service_name: Option<String>,
    /// `OTEL_EXPORTER_OTLP_PROTOCOL`
    pub protocol: Option<String>,
    /// `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL`
    pub traces_protocol: Option<String>,
}

impl OtelEnv {
    /// The process's variables (empty ones count as unset, as the OpenTelemetry SDKs do).
    pub fn from_process() -> Self {
        let var = |name| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        Self {
            endpoint: var(OTEL_ENDPOINT_ENV),
            traces_endpoint: var(OTEL_TRACES_ENDPOINT_ENV),
            service_name: var(OTEL_SERVICE_NAME_ENV),
            protocol: var(OTEL_PROTOCOL_ENV),
            traces_protocol: var(OTEL_TRACES_PROTOCOL_ENV),
        }
    }
}

/// The OTLP transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpProtocol {
    /// `http/protobuf`: `POST <endpoint>/v1/traces`.
    HttpProtobuf,
    /// `grpc`: the `TraceService/Export` call at the endpoint.
    Grpc,
}

impl OtlpProtocol {
    /// Both, with the names `tracing.protocol` takes.
    const NAMED: [(&'static str, Self); 2] =
        [("http/protobuf", Self::HttpProtobuf), ("grpc", Self::Grpc)];

    /// Its name, as `tracing.protocol` writes it.
    pub fn as_str(self) -> &'static str {
        Self::NAMED
            .iter()
            .find(|(_, p)| *p == self)
            .map_or("", |(name, _)| name)
    }
}

/// The validated `[tracing]`, present only when tracing is on.
#[derive(Debug, Clone, PartialEq)]
pub struct TracingConfig {
    /// Where spans are sent: the full `…/v1/traces` URL (HTTP) or the gRPC endpoint.
    pub endpoint: String,
    /// How.
    pub protocol: OtlpProtocol,
    /// `service.name`.
    pub service_name: String,
    /// Root sampling ratio, 0.0 to 1.0.
    pub sample_ratio: f64,
}

impl RawTracing {
    /// `None` when no endpoint is configured (tracing off); else the checked settings. Each
    /// rejection names the key (or the `OTEL_*` variable) the value came from.
    pub(super) fn validate(self, env: &OtelEnv) -> Result<Option<TracingConfig>, ConfigError> {
        let sample_ratio = self.sample_ratio.unwrap_or(1.0);
        if !(0.0..=1.0).contains(&sample_ratio) {
            return Err(ConfigError::invalid(
                "tracing.sample_ratio",
                format!("{sample_ratio} is not between 0.0 and 1.0"),
            ));
        }
        let (protocol_key, protocol) = match (self.protocol, &env.traces_protocol, &env.protocol) {
            (Some(p), _, _) => ("tracing.protocol", p),
            (None, Some(p), _) => (OTEL_TRACES_PROTOCOL_ENV, p.clone()),
            (None, None, Some(p)) => (OTEL_PROTOCOL_ENV, p.clone()),
            (None, None, None) => ("tracing.protocol", "http/protobuf".to_owned()),
        };
        let protocol = choose(protocol_key, protocol.trim(), &OtlpProtocol::NAMED)?;
        let service_name = match (self.service_name, &env.service_name) {
            (Some(s), _) if s.trim().is_empty() => {
                return Err(ConfigError::invalid(
                    "tracing.service_name",
                    "is empty (remove it to use OTEL_SERVICE_NAME or \"outbox-relay\")",
                ));
            }
            (Some(s), _) => s,
            (None, Some(s)) => s.clone(),
            (None, None) => DEFAULT_SERVICE_NAME.to_owned(),
        };
        // A base URL gets `/v1/traces` over HTTP; the traces-only variable is the whole URL.
        let (endpoint_key, endpoint, base) =
            match (self.otlp_endpoint, &env.traces_endpoint, &env.endpoint) {
                (Some(e), _, _) if !e.trim().is_empty() => ("tracing.otlp_endpoint", e, true),
                (_, Some(e), _) => (OTEL_TRACES_ENDPOINT_ENV, e.clone(), false),
                (_, None, Some(e)) => (OTEL_ENDPOINT_ENV, e.clone(), true),
                _ => return Ok(None),
            };
        let endpoint = endpoint_url(endpoint_key, endpoint.trim(), protocol, base)?;
        Ok(Some(TracingConfig {
            endpoint,
            protocol,
            service_name,
            sample_ratio,
        }))
    }
}

/// Checks the collector's URL and derives where spans go: a base URL gets `/v1/traces` over
/// HTTP (`base`); otherwise, and over gRPC, the endpoint itself.
fn endpoint_url(
    key: &'static str,
    endpoint: &str,
    protocol: OtlpProtocol,
    base: bool,
) -> Result<String, ConfigError> {
    let url = url::Url::parse(endpoint).map_err(|e| {
        ConfigError::invalid(
            key,
            format!(
                "{:?} is not a URL like http://127.0.0.1:4318: {e}",
                crate::redact::redact_url(endpoint)
            ),
        )
    })?;
    match url.scheme() {
        "http" => {}
        "https" => {
            return Err(ConfigError::invalid(
                key,
                "https is not supported: export over http to a collector or agent beside the relay (it may forward over TLS)",
            ));
        }
        other => {
            return Err(ConfigError::invalid(
                key,
                format!("scheme {other:?} is not http (write e.g. http://127.0.0.1:4318)"),
            ));
        }
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(ConfigError::invalid(key, "has no host"));
    }
    // The exporter's errors quote the URL as they are logged: it must hold no secret.
    if !url.username().is_empty() || url.password().is_some() {
        return Err(ConfigError::invalid(
            key,
            format!(
                "{:?} carries credentials; export to a collector or agent beside the relay that needs none",
                crate::redact::redact_url(endpoint)
            ),
        ));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(ConfigError::invalid(
            key,
            "has a query or fragment; give the collector's base URL",
        ));
    }
    Ok(match protocol {
        OtlpProtocol::HttpProtobuf if base => {
            format!("{}/v1/traces", endpoint.trim_end_matches('/'))
        }
        _ => endpoint.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::super::tests::{load_str, rejects};
    use super::*;

    fn raw(endpoint: Option<&str>, service_name: Option<&str>) -> RawTracing {
        RawTracing {
            otlp_endpoint: endpoint.map(str::to_owned),
            service_name: service_name.map(str::to_owned),
            ..RawTracing::default()
        }
    }

    #[test]
    fn off_by_default_and_on_with_an_endpoint() {
        assert_eq!(load_str("", &[]).unwrap().tracing, None);
        let c = load_str(
            "[tracing]\notlp_endpoint = \"http://127.0.0.1:4318/\"\n",
            &[],
        )
        .unwrap()
        .tracing
        .unwrap();
        assert_eq!(
            c,
            TracingConfig {
                endpoint: "http://127.0.0.1:4318/v1/traces".into(),
                protocol: OtlpProtocol::HttpProtobuf,
                service_name: "outbox-relay".into(),
                sample_ratio: 1.0,
            }
        );
        let c = load_str(
            "",
            &[
                ("TRACING__OTLP_ENDPOINT", "http://collector:4317"),
                ("TRACING__PROTOCOL", "grpc"),
                ("TRACING__SAMPLE_RATIO", "0.25"),
                ("TRACING__SERVICE_NAME", "orders-relay"),
            ],
        )
        .unwrap()
        .tracing
        .unwrap();
        assert_eq!(c.endpoint, "http://collector:4317");
        assert_eq!(c.protocol, OtlpProtocol::Grpc);
        assert_eq!(c.service_name, "orders-relay");
        assert!((c.sample_ratio - 0.25).abs() < f64::EPSILON);
    }

    #[test]
    fn standard_otel_variables_fill_what_the_config_leaves_unset() {
        let env = OtelEnv {
            endpoint: Some("http://otel:4318".into()),
            service_name: Some("from-env".into()),
            ..OtelEnv::default()
        };
        let c = raw(None, None).validate(&env).unwrap().unwrap();
        assert_eq!(
            (c.endpoint.as_str(), c.service_name.as_str()),
            ("http://otel:4318/v1/traces", "from-env")
        );
        let c = raw(Some("http://mine:4318"), Some("mine"))
            .validate(&env)
            .unwrap()
            .unwrap();
        assert_eq!(
            (c.endpoint.as_str(), c.service_name.as_str()),
            ("http://mine:4318/v1/traces", "mine")
        );
        let bad = OtelEnv {
            endpoint: Some("localhost:4318".into()),
            ..OtelEnv::default()
        };
        let e = raw(None, None).validate(&bad).unwrap_err().to_string();
        assert!(e.contains(OTEL_ENDPOINT_ENV), "{e}");
        let grpc = OtelEnv {
            protocol: Some("grpc".into()),
            ..env.clone()
        };
        let c = raw(None, None).validate(&grpc).unwrap().unwrap();
        assert_eq!(
            (c.endpoint.as_str(), c.protocol),
            ("http://otel:4318", OtlpProtocol::Grpc)
        );
    }

    #[test]
    fn the_traces_variables_come_before_the_general_ones() {
        let env = OtelEnv {
            endpoint: Some("http://otel:4318".into()),
            traces_endpoint: Some("http://traces:4318/custom/path".into()),
            protocol: Some("grpc".into()),
            traces_protocol: Some("http/protobuf".into()),
            ..OtelEnv::default()
        };
        // The traces URL is used as written: no /v1/traces after it.
        let c = raw(None, None).validate(&env).unwrap().unwrap();
        assert_eq!(
            (c.endpoint.as_str(), c.protocol),
            ("http://traces:4318/custom/path", OtlpProtocol::HttpProtobuf)
        );
        // The relay's own key still wins.
        let c = raw(Some("http://mine:4318"), None)
            .validate(&env)
            .unwrap()
            .unwrap();
        assert_eq!(c.endpoint, "http://mine:4318/v1/traces");
        let bad = OtelEnv {
            traces_endpoint: Some("collector:4318".into()),
            ..env
        };
        let e = raw(None, None).validate(&bad).unwrap_err().to_string();
        assert!(e.contains(OTEL_TRACES_ENDPOINT_ENV), "{e}");
    }

    #[test]
    fn each_rejection_names_its_key() {
        let t = |body: &str| format!("[tracing]\n{body}\n");
        rejects(
            &t("otlp_endpoint = \"not a url\""),
            "invalid value for tracing.otlp_endpoint: \"not a url\" is not a URL",
        );
        rejects(
            &t("otlp_endpoint = \"ftp://collector:4318\""),
            "invalid value for tracing.otlp_endpoint: scheme \"ftp\"",
        );
        rejects(
            &t("otlp_endpoint = \"https://collector:4318\""),
            "invalid value for tracing.otlp_endpoint: https is not supported",
        );
        rejects(
            &t("otlp_endpoint = \"http://collector:4318/?a=b\""),
            "invalid value for tracing.otlp_endpoint: has a query",
        );
        rejects(
            &t("otlp_endpoint = \"http://c:4318\"\nprotocol = \"http/json\""),
            "invalid value for tracing.protocol: \"http/json\" is not one of \"http/protobuf\", \"grpc\"",
        );
        rejects(
            &t("sample_ratio = 1.5"),
            "invalid value for tracing.sample_ratio: 1.5 is not between 0.0 and 1.0",
        );
        rejects(
            &t("service_name = \" \""),
            "invalid value for tracing.service_name: is empty",
        );
        rejects(&t("endpoint = \"x\""), "configuration error at tracing");
    }

    #[test]
    fn a_password_in_a_bad_endpoint_is_not_shown() {
        let e = raw(Some("http://u:hunter2@[::1"), None)
            .validate(&OtelEnv::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("tracing.otlp_endpoint") && !e.contains("hunter2"),
            "{e}"
        );
    }
}
