//! Checks of `deploy/` that need no running service (docs/operations.md): the compose file, the
//! Kubernetes example, the container's relay.toml and the Dockerfile hang together; the Grafana
//! dashboard and the Prometheus rules parse and name only metrics the relay exports; the alert
//! rules pass `promtool check rules` and their unit tests (`promtool test rules`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

mod common;

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use common::{TempDir, repo_file, repo_path};
use outbox_relay::config::{Config, ConfigSource};
use outbox_relay::telemetry::names;
use serde::Deserialize as _;
use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

fn deploy(rel: &str) -> PathBuf {
    repo_path(&format!("deploy/{rel}"))
}

/// Parses every document of the YAML file `deploy/{rel}`, with `<<` merge keys applied.
fn yaml_docs(rel: &str) -> Vec<Yaml> {
    let text = repo_file(&format!("deploy/{rel}"));
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let mut v = Yaml::deserialize(doc)
                .unwrap_or_else(|e| panic!("deploy/{rel} is not valid YAML: {e}"));
            v.apply_merge()
                .unwrap_or_else(|e| panic!("deploy/{rel}: bad merge key: {e}"));
            v
        })
        .filter(|v| !v.is_null())
        .collect()
}

fn yaml(rel: &str) -> Yaml {
    let mut docs = yaml_docs(rel);
    assert_eq!(docs.len(), 1, "deploy/{rel} should hold one YAML document");
    docs.remove(0)
}

/// `v.a.b…` for a dotted `path`, panicking with the path when a step is missing.
fn at<'a>(v: &'a Yaml, path: &str) -> &'a Yaml {
    path.split('.').fold(v, |cur, key| {
        cur.get(key)
            .unwrap_or_else(|| panic!("missing key {key} of {path}"))
    })
}

fn s<'a>(v: &'a Yaml, path: &str) -> &'a str {
    let v = at(v, path);
    v.as_str().unwrap_or_else(|| panic!("{path}: not a string"))
}

fn seq<'a>(v: &'a Yaml, path: &str) -> &'a [Yaml] {
    let v = at(v, path);
    v.as_sequence()
        .unwrap_or_else(|| panic!("{path}: not a list"))
}

/// The item of `list` whose `key` is `value`; panics with `what` (what was looked for) when
/// there is none.
fn find<'a>(list: &'a [Yaml], key: &str, value: &str, what: &str) -> &'a Yaml {
    let item = list
        .iter()
        .find(|i| i.get(key).and_then(Yaml::as_str) == Some(value));
    item.unwrap_or_else(|| panic!("{what} (no item whose {key} is {value})"))
}

/// A configuration file loaded exactly as `--config PATH` would, with no `RELAY_*` variables.
fn load_config(path: &Path) -> Config {
    Config::load_with_env(
        &ConfigSource::Explicit(path.to_owned()),
        figment::providers::Env::prefixed("OUTBOX_RELAY_DEPLOY_TEST_NOTHING_"),
    )
    .unwrap_or_else(|e| panic!("{} is not a valid relay configuration: {e}", path.display()))
}

/// Asserts that `c` serves metrics (and the probes) on every interface, port 9187.
fn assert_listens_everywhere(c: &Config, why: &str) {
    let listen = c.metrics_listen.map(|a| a.to_string());
    assert_eq!(listen.as_deref(), Some("0.0.0.0:9187"), "{why}");
}

/// Every metric name a PromQL text uses: `outbox_[a-z_]+` tokens (starting a word) with the
/// histogram suffixes (`_bucket`, `_sum`, `_count`) stripped.
fn metric_names(promql: &str) -> BTreeSet<String> {
    promql
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .filter(|word| word.starts_with("outbox_"))
        .map(|word| {
            let end = word.find(|c: char| !(c.is_ascii_lowercase() || c == '_'));
            let token = &word[..end.unwrap_or(word.len())];
            let suffixes = ["_bucket", "_sum", "_count"];
            let name = suffixes.iter().find_map(|s| token.strip_suffix(s));
            name.unwrap_or(token).to_owned()
        })
        .collect()
}

fn assert_known_metrics(what: &str, exprs: &[String]) -> BTreeSet<String> {
    let mut used = BTreeSet::new();
    for e in exprs {
        for name in metric_names(e) {
            assert!(
                names::ALL.contains(&name.as_str()),
                "{what} uses {name}, which the relay does not export (telemetry::names::ALL); in: {e}"
            );
            used.insert(name);
        }
    }
    used
}

#[test]
fn metric_name_extraction_strips_histogram_suffixes() {
    let got = metric_names(
        "histogram_quantile(0.9, rate(outbox_end_to_end_latency_seconds_bucket[5m])) + \
         rate(outbox_claim_batch_size_sum[1m]) / my_outbox_thing + outbox_published_total",
    );
    let want = [
        "outbox_end_to_end_latency_seconds",
        "outbox_claim_batch_size",
        "outbox_published_total",
    ];
    assert_eq!(got, want.map(str::to_owned).into());
}

// ---- the container image ----------------------------------------------------------------------

#[test]
fn container_relay_toml_is_valid_and_listens_on_every_interface() {
    let c = load_config(&deploy("relay.toml"));
    let why = "inside a container the metrics server must listen on every interface";
    assert_listens_everywhere(&c, why);
    assert!(
        !c.database.auto_migrate,
        "the image leaves migrations to `outbox-relay migrate`"
    );
    assert!(
        !c.console.show_payloads,
        "the console shares the port every interface reaches: payloads stay hidden"
    );
    let text = repo_file("deploy/relay.toml");
    let url = text
        .lines()
        .find(|l| !l.trim_start().starts_with('#') && l.contains("url ="));
    assert_eq!(
        url, None,
        "secrets belong in RELAY_* variables, not in the baked-in relay.toml"
    );
}

/// `(source, destination)` of every `COPY` from the build context (not `--from` a stage).
fn docker_copies(text: &str) -> Vec<(&str, &str)> {
    let mut copied = Vec::new();
    let copies = text.lines().filter_map(|l| l.trim().strip_prefix("COPY "));
    for rest in copies.filter(|r| !r.starts_with("--from")) {
        let parts: Vec<&str> = rest.split_whitespace().collect();
        let (dest, sources) = parts.split_last().expect("COPY has a destination");
        copied.extend(sources.iter().map(|s| (*s, *dest)));
    }
    copied
}

#[test]
fn dockerfile_is_multi_stage_non_root_and_copies_what_the_build_needs() {
    let text = repo_file("deploy/Dockerfile");
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let froms: Vec<&&str> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "a builder and a runtime stage: {froms:?}");
    let builder = froms[0];
    assert!(
        builder.starts_with("FROM rust:1-bookworm AS builder"),
        "{builder}"
    );
    assert_eq!(*froms[1], "FROM debian:bookworm-slim");
    for needed in ["cmake", "make", "gcc", "libssl-dev", "ca-certificates"] {
        assert!(
            text.contains(needed),
            "the Dockerfile should install {needed}"
        );
    }
    // The entry point, the metrics port, and RELAY_CONFIG pointing at the image's configuration.
    for line in [
        r#"ENTRYPOINT ["outbox-relay"]"#,
        r#"CMD ["run"]"#,
        "EXPOSE 9187",
        "ENV RELAY_CONFIG=/etc/outbox-relay/relay.toml",
    ] {
        assert!(lines.contains(&line), "the Dockerfile lacks {line:?}");
    }
    let user = lines.iter().rev().find_map(|l| l.strip_prefix("USER "));
    let user = user.expect("a USER instruction");
    assert!(
        !user.starts_with("root") && !user.starts_with("0"),
        "the runtime runs as root: USER {user}"
    );
    // Every COPY from the build context names something that exists (the context is the
    // repository root) and that the allow-list .dockerignore keeps in the context; the image's
    // config is the one tested above.
    let copied = docker_copies(&text);
    let ignore = repo_file("deploy/Dockerfile.dockerignore");
    for (src, _) in &copied {
        assert!(
            repo_path(src).exists(),
            "COPY {src}: no such file in the repository"
        );
        let src = src.trim_end_matches('/');
        assert!(
            ignore
                .lines()
                .any(|l| l.trim().trim_end_matches('/') == format!("!{src}")),
            "Dockerfile.dockerignore must let {src} into the build context"
        );
    }
    for needed in ["src", "sql", "Cargo.toml", "Cargo.lock"] {
        assert!(
            copied.iter().any(|(s, _)| *s == needed),
            "the builder stage must COPY {needed}"
        );
    }
    assert!(copied.contains(&("deploy/relay.toml", "/etc/outbox-relay/relay.toml")));
    // The builder receives every file the manifest needs.
    let sources: Vec<&str> = copied
        .iter()
        .map(|(s, _)| s.trim_end_matches('/'))
        .collect();
    for path in manifest_files() {
        let has = |c: &&str| path == *c || path.starts_with(&format!("{c}/"));
        assert!(
            sources.iter().any(has),
            "Cargo.toml needs {path}, which deploy/Dockerfile does not COPY into the builder \
             (add it there and to deploy/Dockerfile.dockerignore)"
        );
    }
}

/// The runtime stage (debian:bookworm-slim) must provide every shared library the binary links:
/// `ldd` on the binary built here, each library mapped to the package that ships it, and each
/// package either in the slim base image or installed by the runtime stage.
#[test]
fn the_runtime_image_has_every_library_the_binary_links() {
    let out = Command::new("ldd").arg(common::BIN).output();
    let out = out.expect("run ldd");
    assert!(out.status.success(), "ldd failed: {out:?}");
    let text = repo_file("deploy/Dockerfile");
    let stage = text.find("FROM debian:bookworm-slim");
    let runtime = &text[stage.expect("runtime stage")..];
    // Libraries of packages that debian:bookworm-slim already carries.
    let in_base = [
        "linux-vdso",
        "ld-linux",
        "libc.so",
        "libm.so",
        "libgcc_s",
        "libz.so",
    ];
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let lib = line.split_whitespace().next().unwrap_or_default();
        if lib.is_empty() || in_base.iter().any(|b| lib.contains(b)) {
            continue;
        }
        let package = match lib {
            l if l.starts_with("libssl.so.3") || l.starts_with("libcrypto.so.3") => "libssl3",
            other => panic!(
                "the binary links {other}: map it to its package here and install that in the runtime stage"
            ),
        };
        assert!(
            runtime.contains(package),
            "the binary links {lib}, but the runtime stage does not install {package}"
        );
    }
}

/// Every file Cargo needs to build this package: each target the manifest declares (Cargo
/// refuses to build anything when one is missing), every workspace member's manifest and the
/// build script, if any.
fn manifest_files() -> Vec<String> {
    use figment::providers::{Format as _, Toml};
    let manifest: Json = figment::Figment::from(Toml::file_exact(repo_path("Cargo.toml")))
        .extract()
        .expect("Cargo.toml parses");
    let list = |v: &Json| v.as_array().cloned().unwrap_or_default();
    let package = manifest["package"]["name"].as_str().expect("package.name");
    let mut needed: Vec<String> = Vec::new();
    let kinds = [("bin", "src/bin"), ("bench", "benches")];
    let more = [("example", "examples"), ("test", "tests")];
    for (kind, dir) in kinds.into_iter().chain(more) {
        for target in list(&manifest[kind]) {
            let name = target["name"].as_str().unwrap_or(package);
            needed.push(match target["path"].as_str() {
                Some(p) => p.to_owned(),
                None if kind == "bin" && name == package => "src/main.rs".to_owned(),
                None => format!("{dir}/{name}.rs"),
            });
        }
    }
    // Cargo loads every workspace member, even to build one binary.
    for member in list(&manifest["workspace"]["members"]) {
        if let Some(dir) = member.as_str().filter(|d| *d != ".") {
            needed.push(format!("{dir}/Cargo.toml"));
        }
    }
    match manifest["package"]["build"].as_str() {
        Some(build) => needed.push(build.to_owned()),
        None if repo_path("build.rs").exists() => needed.push("build.rs".to_owned()),
        None => {}
    }
    needed
}

// ---- docker compose ---------------------------------------------------------------------------

#[test]
fn compose_file_runs_the_whole_stack() {
    let compose = yaml("docker-compose.yml");
    let services = at(&compose, "services");
    for name in [
        "postgres",
        "rabbitmq",
        "kafka",
        "relay-migrate",
        "relay",
        "prometheus",
        "grafana",
    ] {
        assert!(
            services.get(name).is_some(),
            "compose has no service {name}"
        );
    }
    assert!(s(services, "rabbitmq.image").contains("management"));
    assert!(s(services, "kafka.image").starts_with("apache/kafka"));
    assert!(
        s(services, "kafka.environment.KAFKA_PROCESS_ROLES").contains("controller"),
        "Kafka runs in KRaft mode (no ZooKeeper)"
    );

    // Both relay services are built from deploy/Dockerfile with the repository as context.
    for svc in ["relay", "relay-migrate"] {
        let service = at(services, svc);
        let context = deploy(".").join(s(service, "build.context"));
        let file = context.join(s(service, "build.dockerfile")).canonicalize();
        let want = deploy("Dockerfile").canonicalize().unwrap();
        assert_eq!(file.unwrap(), want, "{svc} is built from deploy/Dockerfile");
        let env = at(service, "environment");
        assert!(
            s(env, "RELAY_DATABASE__URL").contains("@postgres:5432/"),
            "{svc} reaches the compose PostgreSQL"
        );
        assert!(s(env, "RELAY_PUBLISHER__RABBITMQ__URL").contains("@rabbitmq:5672/"));
        assert_eq!(s(env, "RELAY_PUBLISHER__KAFKA__BROKERS"), "kafka:9092");
        assert_eq!(s(env, "RELAY_METRICS__LISTEN"), "0.0.0.0:9187");
    }
    assert_eq!(seq(services, "relay-migrate.command"), ["migrate"]);
    assert_eq!(seq(services, "relay.command"), ["run"]);
    assert_eq!(
        s(services, "relay.depends_on.relay-migrate.condition"),
        "service_completed_successfully",
        "the relay starts after the migration succeeded"
    );
    let ports = seq(services, "relay.ports");
    assert!(
        ports.iter().any(|p| p.as_str().unwrap().ends_with(":9187")),
        "the relay's metrics port is published"
    );

    // Prometheus loads this repository's configuration; its scrape target is the relay.
    let prom_cfg = yaml("prometheus/prometheus.yml");
    let targets: Vec<&str> = seq(&prom_cfg, "scrape_configs")
        .iter()
        .filter(|j| j.get("job_name").and_then(Yaml::as_str) == Some("outbox-relay"))
        .flat_map(|j| seq(j, "static_configs"))
        .flat_map(|c| seq(c, "targets"))
        .map(|t| t.as_str().unwrap())
        .collect();
    let why = "Prometheus scrapes the compose relay";
    assert_eq!(targets, ["relay:9187"], "{why}");

    // Grafana's datasource points at the compose Prometheus; the dashboard lands where the
    // provisioning provider looks.
    let ds = yaml("grafana/provisioning/datasources/prometheus.yml");
    let ds0 = &seq(&ds, "datasources")[0];
    assert_eq!(s(ds0, "type"), "prometheus");
    assert_eq!(s(ds0, "url"), "http://prometheus:9090");
    let provider = yaml("grafana/provisioning/dashboards/outbox-relay.yml");
    let dash_dir = s(&seq(&provider, "providers")[0], "options.path");

    // Every bind mount's source exists (paths are relative to deploy/).
    let mut mounts: HashMap<&str, &str> = HashMap::new();
    for (name, svc) in services.as_mapping().unwrap() {
        let volumes = svc.get("volumes").and_then(Yaml::as_sequence);
        for v in volumes.into_iter().flatten() {
            let mut parts = v.as_str().unwrap().split(':');
            let (src, dst) = (parts.next().unwrap(), parts.next().unwrap());
            if src.starts_with("./") || src.starts_with("../") {
                let name = name.as_str().unwrap();
                assert!(
                    deploy(".").join(src).exists(),
                    "service {name} mounts {src}, which does not exist"
                );
                mounts.insert(dst, src);
            }
        }
    }
    // The dashboard is mounted where the provisioning provider reads (`dash_dir`).
    let dashboard = format!("{dash_dir}/outbox-relay.json");
    for (dst, src) in [
        ("/etc/prometheus", "./prometheus"),
        ("/etc/outbox-relay/relay.toml", "./relay.toml"),
        ("/etc/grafana/provisioning", "./grafana/provisioning"),
        (&dashboard, "./grafana/outbox-relay.json"),
    ] {
        assert_eq!(mounts.get(dst), Some(&src), "{dst} should mount {src}");
    }
}

// ---- Kubernetes -------------------------------------------------------------------------------

#[test]
fn kubernetes_sidecar_probes_config_and_secrets_fit_together() {
    let docs = yaml_docs("kubernetes/sidecar.yaml");
    let by_kind = |kind| find(&docs, "kind", kind, &format!("sidecar.yaml has no {kind}"));
    let (config_map, secret) = (by_kind("ConfigMap"), by_kind("Secret"));
    let deployment = by_kind("Deployment");
    assert_eq!(s(deployment, "apiVersion"), "apps/v1");

    // The ConfigMap's relay.toml is a valid configuration that listens on every interface.
    let dir = TempDir::new("deploy");
    let toml = at(config_map, "data")["relay.toml"].as_str();
    let config = load_config(&dir.write("relay.toml", toml.expect("data.relay.toml")));
    let probes = "probes reach the pod IP: metrics.listen must be 0.0.0.0:9187";
    assert_listens_everywhere(&config, probes);
    assert!(
        !config.console.show_payloads,
        "the console shares the pod's metrics port: payloads stay hidden"
    );

    let pod = at(deployment, "spec.template.spec");
    let containers = seq(pod, "containers");
    let relay = find(containers, "name", "outbox-relay", "the relay container");
    assert!(
        containers.iter().any(|c| s(c, "name") != "outbox-relay"),
        "an application container beside the relay"
    );
    assert_eq!(seq(relay, "args")[0].as_str(), Some("run"));

    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(s(relay, &format!("{probe}.httpGet.path")), path);
        let port = at(relay, &format!("{probe}.httpGet.port")).as_u64();
        assert_eq!(port, Some(9187), "{probe} port");
    }
    let ports = seq(relay, "ports");
    assert!(
        ports
            .iter()
            .any(|p| at(p, "containerPort").as_u64() == Some(9187)),
        "the relay's container exposes 9187"
    );
    for key in ["requests", "limits"] {
        let memory = at(relay, &format!("resources.{key}")).get("memory");
        assert!(memory.is_some(), "relay resources.{key}.memory");
    }

    // The config file is the mounted ConfigMap.
    let env_value = |var| find(seq(relay, "env"), "name", var, &format!("relay env {var}"));
    let config_volume = seq(pod, "volumes")
        .iter()
        .find(|v| v.get("configMap").is_some())
        .expect("a ConfigMap volume");
    let volume = s(config_volume, "name");
    let config_map_name = s(config_map, "metadata.name");
    assert_eq!(s(config_volume, "configMap.name"), config_map_name);
    let mounted = "the relay mounts the ConfigMap volume";
    let mount = find(seq(relay, "volumeMounts"), "name", volume, mounted);
    assert_eq!(
        s(env_value("RELAY_CONFIG"), "value"),
        format!("{}/relay.toml", s(mount, "mountPath")),
        "RELAY_CONFIG names the mounted relay.toml"
    );

    // Secrets come from the Secret, by keys it has.
    let secret_keys = at(secret, "stringData").as_mapping().unwrap();
    for var in ["RELAY_DATABASE__URL", "RELAY_PUBLISHER__RABBITMQ__URL"] {
        let r = at(env_value(var), "valueFrom.secretKeyRef");
        let secret_name = s(secret, "metadata.name");
        assert_eq!(s(r, "name"), secret_name, "{var} comes from the Secret");
        let key = s(r, "key");
        let why = format!("{var} names key {key}, which the Secret lacks");
        assert!(secret_keys.contains_key(key), "{why}");
    }

    // The drain on SIGTERM fits in the grace period.
    let grace = at(pod, "terminationGracePeriodSeconds").as_u64().unwrap();
    assert!(
        grace > config.relay.shutdown_timeout.as_secs(),
        "terminationGracePeriodSeconds ({grace}) must exceed relay.shutdown_timeout ({:?})",
        config.relay.shutdown_timeout
    );
}

// ---- Grafana dashboard ------------------------------------------------------------------------

/// Every panel, rows' nested panels included.
fn panels(dashboard: &Json) -> Vec<&Json> {
    let mut out = Vec::new();
    for p in dashboard["panels"].as_array().expect("panels") {
        out.push(p);
        out.extend(p["panels"].as_array().into_iter().flatten());
    }
    out
}

/// The PromQL expressions of a panel's targets.
fn panel_exprs(p: &Json) -> Vec<String> {
    let targets = p["targets"].as_array().into_iter().flatten();
    targets
        .map(|t| t["expr"].as_str().expect("target expr").to_owned())
        .collect()
}

#[test]
fn dashboard_covers_every_metric_and_names_no_other() {
    let d: Json = serde_json::from_str(&repo_file("deploy/grafana/outbox-relay.json"))
        .unwrap_or_else(|e| panic!("deploy/grafana/outbox-relay.json is not valid JSON: {e}"));
    assert_eq!(d["uid"], "outbox-relay");
    let all = panels(&d);
    let vars = d["templating"]["list"].as_array().expect("templating");
    // Every PromQL expression: panel targets and template variable queries.
    let mut exprs: Vec<String> = all.iter().flat_map(|p| panel_exprs(p)).collect();
    let queries = vars.iter().filter_map(|v| v["query"]["query"].as_str());
    exprs.extend(queries.map(str::to_owned));
    let used = assert_known_metrics("the dashboard", &exprs);
    for name in names::ALL {
        let why = format!("the dashboard shows nothing of {name}");
        assert!(used.contains(*name), "{why}");
    }

    let (mut ids, mut titles) = (BTreeSet::new(), BTreeSet::new());
    for p in &all {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        let title = p["title"].as_str().expect("panel title");
        assert!(titles.insert(title), "duplicate panel title {title:?}");
        let w = p["gridPos"]["w"].as_u64();
        assert!(w.is_some(), "panel {id} has a gridPos");
        if p["type"] != "row" {
            let why = format!("panel {title} uses the dashboard's datasource variable");
            assert_eq!(p["datasource"]["uid"], "${datasource}", "{why}");
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "panel {title} has no query");
        }
    }

    // The panels the operations guide describes, by a part of the query they must run.
    let exprs_of = |title: &str| {
        let p = all.iter().find(|p| p["title"] == title);
        panel_exprs(p.unwrap_or_else(|| panic!("no panel titled {title:?}")))
    };
    #[rustfmt::skip]
    let wanted = [
        ("Lag: oldest ready, waiting and unsent", "outbox_oldest_ready_age_seconds"),
        ("Lag: oldest ready, waiting and unsent", "outbox_oldest_waiting_age_seconds"),
        ("Lag", "outbox_oldest_ready_age_seconds"),
        ("Table health: dead tuples and relay vacuums", "outbox_table_dead_tuples"),
        ("Pending: ready vs waiting", "max by (outbox, state) (outbox_pending_messages"),
        ("Throughput by outbox", "sum by (outbox) (rate(outbox_published_total"),
        ("Throughput by aggregate type", "sum by (aggregate_type) (rate(outbox_published_total"),
        ("Publish failures by kind", "sum by (kind) (rate(outbox_publish_failures_total"),
        ("Dead letters and newly failed", "outbox_failed_messages"),
        ("Dead letters and newly failed", "rate(outbox_dead_lettered_total"),
        ("Blocked aggregates over time", "outbox_blocked_aggregates"),
        ("Expired (never published)", "rate(outbox_expired_total"),
        ("Watermark lag (ordering guard)", "outbox_watermark_lag_seconds"),
        ("Claim batch size", "outbox_claim_batch_size_bucket"),
        ("Broker connection by relay", "outbox_broker_connected"),
    ];
    for (title, needle) in wanted {
        assert!(
            exprs_of(title).iter().any(|e| e.contains(needle)),
            "panel {title:?} should query {needle}"
        );
    }
    let e2e = "End-to-end latency (created_at → confirmed)";
    let publish = "Publish duration (send → confirm)";
    for (title, metric) in [
        (e2e, "outbox_end_to_end_latency_seconds_bucket"),
        (publish, "outbox_publish_duration_seconds_bucket"),
    ] {
        let exprs = exprs_of(title);
        for q in ["0.5", "0.95", "0.99"] {
            let p = format!("histogram_quantile({q},");
            assert!(
                exprs
                    .iter()
                    .any(|e| e.starts_with(&p) && e.contains(metric)),
                "{title} shows p{q} of {metric}"
            );
        }
    }

    // The outbox selector: a multi-value variable over the `outbox` label, and every query of
    // a per-table metric (all but the process-wide ones) filters by it.
    let outbox = vars.iter().find(|v| v["name"] == "outbox");
    let outbox = outbox.expect("an `outbox` template variable");
    let query = outbox["query"]["query"].as_str().unwrap();
    assert!(
        query.starts_with("label_values(outbox_") && query.ends_with(", outbox)"),
        "{outbox}"
    );
    assert_eq!(outbox["multi"], true);
    assert_eq!(outbox["includeAll"], true);
    for p in &all {
        for expr in panel_exprs(p) {
            let process_wide = ["outbox_relay_info", "outbox_broker_connected", "up{"];
            if !process_wide.iter().any(|m| expr.contains(m)) {
                assert_eq!(
                    expr.matches('{').count(),
                    expr.matches("outbox=~\"$outbox\"").count(),
                    "panel {}: every selector filters by $outbox: {expr}",
                    p["title"]
                );
            }
        }
    }
}

// ---- Prometheus rules -------------------------------------------------------------------------

#[test]
fn alert_rules_name_known_metrics_and_each_has_both_unit_test_cases() {
    let file = yaml("prometheus/alerts.yml");
    let groups = seq(&file, "groups");
    let rules: Vec<&Yaml> = groups.iter().flat_map(|g| seq(g, "rules")).collect();
    let alert_names: BTreeSet<&str> = rules.iter().map(|r| s(r, "alert")).collect();
    for required in [
        "OutboxLagHigh",
        "OutboxDeadLetters",
        "OutboxBlockedAggregates",
        "OutboxRelayDown",
        "OutboxNoProgress",
        "OutboxBrokerDown",
    ] {
        assert!(
            alert_names.contains(required),
            "alerts.yml lacks {required}"
        );
    }
    let exprs: Vec<String> = rules.iter().map(|r| s(r, "expr").to_owned()).collect();
    let used = assert_known_metrics("alerts.yml", &exprs);
    for needed in [
        names::OLDEST_READY_AGE,
        names::FAILED,
        names::BLOCKED_AGGREGATES,
        names::PUBLISHED,
        names::BROKER_CONNECTED,
    ] {
        assert!(used.contains(needed), "no alert watches {needed}");
    }

    // Every alert has a test case where it fires and one where it does not.
    let tests = yaml("prometheus/alerts.test.yml");
    let (mut firing, mut silent) = (BTreeSet::new(), BTreeSet::new());
    let cases = seq(&tests, "tests");
    for t in cases.iter().flat_map(|c| seq(c, "alert_rule_test")) {
        let name = s(t, "alertname");
        match seq(t, "exp_alerts").is_empty() {
            true => silent.insert(name),
            false => firing.insert(name),
        };
    }
    for name in &alert_names {
        assert!(firing.contains(name), "no unit test where {name} fires");
        assert!(
            silent.contains(name),
            "no unit test where {name} stays silent"
        );
    }
}

fn promtool(args: &[&str]) {
    let mut promtool = Command::new("promtool");
    promtool.args(args).current_dir(deploy("prometheus"));
    let out = match promtool.output() {
        Ok(out) => out,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => panic!(
            "promtool is not installed: install it with `apt-get update && apt-get install -y prometheus` \
             (.ci/run does this in CI)"
        ),
        Err(e) => panic!("cannot run promtool: {e}"),
    };
    assert!(
        out.status.success(),
        "promtool {} failed ({}):\n{}{}",
        args.join(" "),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn promtool_checks_the_rules_and_runs_their_unit_tests() {
    promtool(&["check", "rules", "alerts.yml"]);
    promtool(&["test", "rules", "alerts.test.yml"]);
    promtool(&["check", "config", "prometheus.yml"]);
}
