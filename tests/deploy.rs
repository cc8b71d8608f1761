//! Checks of `deploy/` that need no running service (contract §8): the compose file, the
//! Kubernetes example, the container's relay.toml and the Dockerfile hang together; the Grafana
//! dashboard and the Prometheus rules parse and name only metrics the relay exports; the alert
//! rules pass `promtool check rules` and their unit tests (`promtool test rules`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

use outbox_relay::config::{Config, ConfigSource};
use outbox_relay::telemetry::names;
use serde_json::Value as Json;
use serde_yaml::Value as Yaml;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn deploy(rel: &str) -> PathBuf {
    repo().join("deploy").join(rel)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Parses every document of a YAML file, with `<<` merge keys applied.
fn yaml_docs(path: &Path) -> Vec<Yaml> {
    let text = read(path);
    serde_yaml::Deserializer::from_str(&text)
        .map(|doc| {
            let mut v = Yaml::deserialize(doc)
                .unwrap_or_else(|e| panic!("{} is not valid YAML: {e}", path.display()));
            v.apply_merge()
                .unwrap_or_else(|e| panic!("{}: bad merge key: {e}", path.display()));
            v
        })
        .filter(|v| !v.is_null())
        .collect()
}

use serde::Deserialize as _;

fn yaml(path: &Path) -> Yaml {
    let mut docs = yaml_docs(path);
    assert_eq!(
        docs.len(),
        1,
        "{} should hold one YAML document",
        path.display()
    );
    docs.remove(0)
}

/// `v[a][b]…`, panicking with the path when a step is missing.
fn at<'a>(v: &'a Yaml, path: &[&str]) -> &'a Yaml {
    let mut cur = v;
    for (i, key) in path.iter().enumerate() {
        cur = cur
            .get(*key)
            .unwrap_or_else(|| panic!("missing key {}", path[..=i].join(".")));
    }
    cur
}

fn s<'a>(v: &'a Yaml, path: &[&str]) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("{} is not a string", path.join(".")))
}

/// A configuration file loaded exactly as `--config PATH` would, with no `RELAY_*` variables.
fn load_config(path: &Path) -> Config {
    Config::load_with_env(
        &ConfigSource::Explicit(path.to_owned()),
        figment::providers::Env::prefixed("OUTBOX_RELAY_DEPLOY_TEST_NOTHING_"),
    )
    .unwrap_or_else(|e| panic!("{} is not a valid relay configuration: {e}", path.display()))
}

/// Every metric name a PromQL text uses: `outbox_[a-z_]+` tokens with the histogram suffixes
/// (`_bucket`, `_sum`, `_count`) stripped.
fn metric_names(promql: &str) -> BTreeSet<String> {
    let bytes = promql.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while let Some(pos) = promql[i..].find("outbox_") {
        let start = i + pos;
        let boundary = start == 0 || {
            let c = bytes[start - 1];
            !(c.is_ascii_alphanumeric() || c == b'_')
        };
        let mut end = start + "outbox_".len();
        while end < bytes.len() && (bytes[end].is_ascii_lowercase() || bytes[end] == b'_') {
            end += 1;
        }
        if boundary {
            let token = &promql[start..end];
            let name = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| token.strip_suffix(suffix))
                .unwrap_or(token);
            out.insert(name.to_owned());
        }
        i = end;
    }
    out
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
    let want: BTreeSet<String> = [
        "outbox_end_to_end_latency_seconds",
        "outbox_claim_batch_size",
        "outbox_published_total",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    assert_eq!(got, want);
}

// ---- the container image ----------------------------------------------------------------------

#[test]
fn container_relay_toml_is_valid_and_listens_on_every_interface() {
    let c = load_config(&deploy("relay.toml"));
    assert_eq!(
        c.metrics_listen.map(|a| a.to_string()).as_deref(),
        Some("0.0.0.0:9187"),
        "inside a container the metrics server must listen on every interface"
    );
    assert!(
        !c.database.auto_migrate,
        "the image leaves migrations to `outbox-relay migrate`"
    );
    let text = read(&deploy("relay.toml"));
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        assert!(
            !line.contains("url ="),
            "secrets belong in RELAY_* variables, not in the baked-in relay.toml: {line}"
        );
    }
}

#[test]
fn dockerfile_is_multi_stage_non_root_and_copies_what_exists() {
    let text = read(&deploy("Dockerfile"));
    let lines: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let froms: Vec<&&str> = lines.iter().filter(|l| l.starts_with("FROM ")).collect();
    assert_eq!(froms.len(), 2, "a builder and a runtime stage: {froms:?}");
    assert!(
        froms[0].starts_with("FROM rust:1-bookworm AS builder"),
        "{}",
        froms[0]
    );
    assert_eq!(*froms[1], "FROM debian:bookworm-slim");
    for needed in ["cmake", "make", "gcc", "libssl-dev", "ca-certificates"] {
        assert!(
            text.contains(needed),
            "the Dockerfile should install {needed}"
        );
    }
    assert!(lines.contains(&r#"ENTRYPOINT ["outbox-relay"]"#));
    assert!(lines.contains(&r#"CMD ["run"]"#));
    assert!(lines.contains(&"EXPOSE 9187"));
    let user = lines
        .iter()
        .rev()
        .find_map(|l| l.strip_prefix("USER "))
        .expect("a USER instruction");
    assert!(
        !user.starts_with("root") && !user.starts_with("0"),
        "the runtime runs as root: USER {user}"
    );
    assert!(
        lines.contains(&"ENV RELAY_CONFIG=/etc/outbox-relay/relay.toml"),
        "the image points RELAY_CONFIG at its configuration"
    );
    // Every COPY from the build context names something that exists (the context is the
    // repository root), and the image's config is the one tested above.
    let copied = docker_copies(&lines);
    for (src, _) in &copied {
        assert!(
            repo().join(src).exists(),
            "COPY {src}: no such file in the repository"
        );
    }
    for needed in ["src", "sql", "Cargo.toml", "Cargo.lock"] {
        assert!(
            copied.iter().any(|(s, _)| s == needed),
            "the builder stage must COPY {needed}"
        );
    }
    assert!(copied.contains(&(
        "deploy/relay.toml".to_owned(),
        "/etc/outbox-relay/relay.toml".to_owned()
    )));
    // The allow-list .dockerignore keeps every COPY source in the context.
    let ignore = read(&deploy("Dockerfile.dockerignore"));
    for (src, _) in &copied {
        let src = src.trim_end_matches('/');
        assert!(
            ignore
                .lines()
                .any(|l| l.trim().trim_end_matches('/') == format!("!{src}")),
            "Dockerfile.dockerignore must let {src} into the build context"
        );
    }
}

/// `(source, destination)` of every `COPY` from the build context (not `--from` a stage).
fn docker_copies(lines: &[&str]) -> Vec<(String, String)> {
    let mut copied = Vec::new();
    for l in lines {
        let Some(rest) = l.strip_prefix("COPY ") else {
            continue;
        };
        if rest.starts_with("--from") {
            continue;
        }
        let parts: Vec<&str> = rest.split_whitespace().collect();
        let (dest, sources) = parts.split_last().expect("COPY has a destination");
        for src in sources {
            copied.push(((*src).to_owned(), (*dest).to_owned()));
        }
    }
    copied
}

/// The runtime stage (debian:bookworm-slim) must provide every shared library the binary links:
/// `ldd` on the binary built here, each library mapped to the package that ships it, and each
/// package either in the slim base image or installed by the runtime stage.
#[test]
fn the_runtime_image_has_every_library_the_binary_links() {
    let out = std::process::Command::new("ldd")
        .arg(env!("CARGO_BIN_EXE_outbox-relay"))
        .output()
        .expect("run ldd");
    assert!(out.status.success(), "ldd failed: {out:?}");
    let text = read(&deploy("Dockerfile"));
    let runtime = &text[text
        .find("FROM debian:bookworm-slim")
        .expect("runtime stage")..];
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

/// Cargo refuses to build anything when a target the manifest declares is missing, so the
/// image must receive every declared target's file (and a build script, if any).
#[test]
fn dockerfile_copies_every_file_the_manifest_needs() {
    let text = read(&deploy("Dockerfile"));
    let lines: Vec<&str> = text.lines().map(str::trim).collect();
    let copied: Vec<String> = docker_copies(&lines)
        .into_iter()
        .map(|(s, _)| s.trim_end_matches('/').to_owned())
        .collect();
    use figment::providers::Format as _;
    let manifest: Json = figment::Figment::from(figment::providers::Toml::file_exact(
        repo().join("Cargo.toml"),
    ))
    .extract()
    .expect("Cargo.toml parses");
    let package = manifest["package"]["name"].as_str().expect("package.name");
    let mut needed: Vec<String> = Vec::new();
    for (kind, dir) in [
        ("bin", "src/bin"),
        ("bench", "benches"),
        ("example", "examples"),
        ("test", "tests"),
    ] {
        for target in manifest[kind].as_array().cloned().unwrap_or_default() {
            let name = target["name"].as_str().unwrap_or(package);
            let path = match target["path"].as_str() {
                Some(p) => p.to_owned(),
                None if kind == "bin" && name == package => "src/main.rs".to_owned(),
                None => format!("{dir}/{name}.rs"),
            };
            needed.push(path);
        }
    }
    // Cargo loads every workspace member, even to build one binary.
    for member in manifest["workspace"]["members"]
        .as_array()
        .cloned()
        .unwrap_or_default()
    {
        match member.as_str() {
            Some(".") | None => {}
            Some(dir) => needed.push(format!("{dir}/Cargo.toml")),
        }
    }
    match manifest["package"]["build"].as_str() {
        Some(build) => needed.push(build.to_owned()),
        None if repo().join("build.rs").exists() => needed.push("build.rs".to_owned()),
        None => {}
    }
    for path in needed {
        assert!(
            copied
                .iter()
                .any(|c| path == *c || path.starts_with(&format!("{c}/"))),
            "Cargo.toml needs {path}, which deploy/Dockerfile does not COPY into the builder \
             (add it there and to deploy/Dockerfile.dockerignore)"
        );
    }
}

// ---- docker compose ---------------------------------------------------------------------------

#[test]
fn compose_file_runs_the_whole_stack() {
    let path = deploy("docker-compose.yml");
    let compose = yaml(&path);
    let services = at(&compose, &["services"]);
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
    assert!(s(services, &["rabbitmq", "image"]).contains("management"));
    assert!(s(services, &["kafka", "image"]).starts_with("apache/kafka"));
    assert!(
        s(services, &["kafka", "environment", "KAFKA_PROCESS_ROLES"]).contains("controller"),
        "Kafka runs in KRaft mode (no ZooKeeper)"
    );

    // Both relay services are built from deploy/Dockerfile with the repository as context.
    for svc in ["relay", "relay-migrate"] {
        let context = deploy(".").join(s(services, &[svc, "build", "context"]));
        let dockerfile = context.join(s(services, &[svc, "build", "dockerfile"]));
        assert_eq!(
            dockerfile.canonicalize().unwrap(),
            deploy("Dockerfile").canonicalize().unwrap(),
            "{svc} is built from deploy/Dockerfile"
        );
        let env = at(services, &[svc, "environment"]);
        assert!(
            s(env, &["RELAY_DATABASE__URL"]).contains("@postgres:5432/"),
            "{svc} reaches the compose PostgreSQL"
        );
        assert!(s(env, &["RELAY_PUBLISHER__RABBITMQ__URL"]).contains("@rabbitmq:5672/"));
        assert_eq!(s(env, &["RELAY_PUBLISHER__KAFKA__BROKERS"]), "kafka:9092");
        assert_eq!(s(env, &["RELAY_METRICS__LISTEN"]), "0.0.0.0:9187");
    }
    let command = |svc: &str| -> Vec<String> {
        at(services, &[svc, "command"])
            .as_sequence()
            .expect("command list")
            .iter()
            .map(|v| v.as_str().unwrap().to_owned())
            .collect()
    };
    assert_eq!(command("relay-migrate"), ["migrate"]);
    assert_eq!(command("relay"), ["run"]);
    assert_eq!(
        s(
            services,
            &["relay", "depends_on", "relay-migrate", "condition"]
        ),
        "service_completed_successfully",
        "the relay starts after the migration succeeded"
    );
    let relay_ports = at(services, &["relay", "ports"]).as_sequence().unwrap();
    assert!(
        relay_ports
            .iter()
            .any(|p| p.as_str().unwrap().ends_with(":9187")),
        "the relay's metrics port is published"
    );

    // Prometheus loads this repository's configuration; its scrape target is the relay.
    let prom_cfg = yaml(&deploy("prometheus/prometheus.yml"));
    let targets: Vec<String> = at(&prom_cfg, &["scrape_configs"])
        .as_sequence()
        .unwrap()
        .iter()
        .filter(|j| j.get("job_name").and_then(Yaml::as_str) == Some("outbox-relay"))
        .flat_map(|j| at(j, &["static_configs"]).as_sequence().unwrap().clone())
        .flat_map(|c| at(&c, &["targets"]).as_sequence().unwrap().clone())
        .map(|t| t.as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        targets,
        ["relay:9187"],
        "Prometheus scrapes the compose relay"
    );

    // Grafana's datasource points at the compose Prometheus; the dashboard lands where the
    // provisioning provider looks.
    let ds = yaml(&deploy("grafana/provisioning/datasources/prometheus.yml"));
    let ds0 = &at(&ds, &["datasources"]).as_sequence().unwrap()[0];
    assert_eq!(s(ds0, &["type"]), "prometheus");
    assert_eq!(s(ds0, &["url"]), "http://prometheus:9090");
    let provider = yaml(&deploy("grafana/provisioning/dashboards/outbox-relay.yml"));
    let dash_dir = s(
        &at(&provider, &["providers"]).as_sequence().unwrap()[0],
        &["options", "path"],
    )
    .to_owned();

    // Every bind mount's source exists (paths are relative to deploy/).
    let mut mounts: HashMap<String, String> = HashMap::new();
    for (name, svc) in services.as_mapping().unwrap() {
        let Some(volumes) = svc.get("volumes").and_then(Yaml::as_sequence) else {
            continue;
        };
        for v in volumes {
            let v = v.as_str().unwrap();
            let mut parts = v.split(':');
            let (src, dst) = (parts.next().unwrap(), parts.next().unwrap());
            if src.starts_with("./") || src.starts_with("../") {
                assert!(
                    deploy(".").join(src).exists(),
                    "service {} mounts {src}, which does not exist",
                    name.as_str().unwrap()
                );
                mounts.insert(dst.to_owned(), src.to_owned());
            }
        }
    }
    assert_eq!(
        mounts.get("/etc/prometheus").map(String::as_str),
        Some("./prometheus")
    );
    assert_eq!(
        mounts
            .get("/etc/outbox-relay/relay.toml")
            .map(String::as_str),
        Some("./relay.toml")
    );
    assert_eq!(
        mounts.get("/etc/grafana/provisioning").map(String::as_str),
        Some("./grafana/provisioning")
    );
    assert_eq!(
        mounts
            .get(&format!("{dash_dir}/outbox-relay.json"))
            .map(String::as_str),
        Some("./grafana/outbox-relay.json"),
        "the dashboard is mounted where the provisioning provider reads ({dash_dir})"
    );
}

// ---- Kubernetes -------------------------------------------------------------------------------

#[test]
fn kubernetes_sidecar_probes_config_and_secrets_fit_together() {
    let docs = yaml_docs(&deploy("kubernetes/sidecar.yaml"));
    let by_kind = |kind: &str| -> &Yaml {
        docs.iter()
            .find(|d| d.get("kind").and_then(Yaml::as_str) == Some(kind))
            .unwrap_or_else(|| panic!("sidecar.yaml has no {kind}"))
    };
    let config_map = by_kind("ConfigMap");
    let secret = by_kind("Secret");
    let deployment = by_kind("Deployment");
    assert_eq!(s(deployment, &["apiVersion"]), "apps/v1");

    // The ConfigMap's relay.toml is a valid configuration that listens on every interface.
    let dir = std::env::temp_dir().join(format!("outbox-relay-deploy-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let toml_path = dir.join("relay.toml");
    std::fs::write(&toml_path, s(config_map, &["data", "relay.toml"])).unwrap();
    let config = load_config(&toml_path);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(
        config.metrics_listen.map(|a| a.to_string()).as_deref(),
        Some("0.0.0.0:9187"),
        "probes reach the pod IP: metrics.listen must be 0.0.0.0:9187"
    );

    let pod = at(deployment, &["spec", "template", "spec"]);
    let containers = at(pod, &["containers"]).as_sequence().unwrap();
    assert!(
        containers.len() >= 2,
        "an application container plus the relay"
    );
    let relay = containers
        .iter()
        .find(|c| s(c, &["name"]) == "outbox-relay")
        .expect("a container named outbox-relay");
    assert!(
        containers.iter().any(|c| s(c, &["name"]) != "outbox-relay"),
        "the application container"
    );
    assert_eq!(
        at(relay, &["args"]).as_sequence().unwrap()[0].as_str(),
        Some("run")
    );

    for (probe, path) in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")] {
        assert_eq!(s(relay, &[probe, "httpGet", "path"]), path);
        assert_eq!(
            at(relay, &[probe, "httpGet", "port"]).as_u64(),
            Some(9187),
            "{probe} port"
        );
    }
    let ports = at(relay, &["ports"]).as_sequence().unwrap();
    assert!(
        ports
            .iter()
            .any(|p| at(p, &["containerPort"]).as_u64() == Some(9187))
    );
    for key in ["requests", "limits"] {
        assert!(
            at(relay, &["resources", key]).get("memory").is_some(),
            "relay resources.{key}.memory"
        );
    }

    // The config file is the mounted ConfigMap.
    let env: Vec<&Yaml> = at(relay, &["env"]).as_sequence().unwrap().iter().collect();
    let env_value = |name: &str| env.iter().find(|e| s(e, &["name"]) == name).copied();
    let config_path = s(env_value("RELAY_CONFIG").expect("RELAY_CONFIG"), &["value"]);
    let config_volume = at(pod, &["volumes"])
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v.get("configMap").is_some())
        .expect("a ConfigMap volume");
    assert_eq!(
        s(config_volume, &["configMap", "name"]),
        s(config_map, &["metadata", "name"])
    );
    let mount = at(relay, &["volumeMounts"])
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| s(m, &["name"]) == s(config_volume, &["name"]))
        .expect("the relay mounts the ConfigMap volume");
    assert_eq!(
        config_path,
        format!("{}/relay.toml", s(mount, &["mountPath"])),
        "RELAY_CONFIG names the mounted relay.toml"
    );

    // Secrets come from the Secret, by keys it has.
    let secret_name = s(secret, &["metadata", "name"]);
    let secret_keys: BTreeSet<&str> = at(secret, &["stringData"])
        .as_mapping()
        .unwrap()
        .keys()
        .map(|k| k.as_str().unwrap())
        .collect();
    for var in ["RELAY_DATABASE__URL", "RELAY_PUBLISHER__RABBITMQ__URL"] {
        let e = env_value(var).unwrap_or_else(|| panic!("relay env {var}"));
        let r = at(e, &["valueFrom", "secretKeyRef"]);
        assert_eq!(s(r, &["name"]), secret_name, "{var} comes from the Secret");
        assert!(
            secret_keys.contains(s(r, &["key"])),
            "{var} names key {}, which the Secret lacks",
            s(r, &["key"])
        );
    }

    // The drain on SIGTERM fits in the grace period.
    let grace = at(pod, &["terminationGracePeriodSeconds"])
        .as_u64()
        .unwrap();
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
        if let Some(inner) = p["panels"].as_array() {
            out.extend(inner);
        }
    }
    out
}

fn dashboard() -> Json {
    let path = deploy("grafana/outbox-relay.json");
    serde_json::from_str(&read(&path))
        .unwrap_or_else(|e| panic!("{} is not valid JSON: {e}", path.display()))
}

/// Every PromQL expression in the dashboard: panel targets and template variable queries.
fn dashboard_exprs(d: &Json) -> Vec<String> {
    let mut out: Vec<String> = panels(d)
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
        .collect();
    for v in d["templating"]["list"].as_array().expect("templating") {
        if let Some(q) = v["query"]["query"].as_str() {
            out.push(q.to_owned());
        }
    }
    out
}

#[test]
fn dashboard_covers_every_metric_and_names_no_other() {
    let d = dashboard();
    assert_eq!(d["uid"], "outbox-relay");
    let exprs = dashboard_exprs(&d);
    let used = assert_known_metrics("the dashboard", &exprs);
    for name in names::ALL {
        assert!(
            used.contains(*name),
            "the dashboard shows nothing of {name}"
        );
    }

    let all = panels(&d);
    let mut ids = BTreeSet::new();
    let mut titles = BTreeSet::new();
    for p in &all {
        let id = p["id"].as_u64().expect("panel id");
        assert!(ids.insert(id), "duplicate panel id {id}");
        let title = p["title"].as_str().expect("panel title");
        assert!(titles.insert(title), "duplicate panel title {title:?}");
        assert!(
            p["gridPos"]["w"].as_u64().is_some(),
            "panel {id} has a gridPos"
        );
        if p["type"] != "row" {
            assert_eq!(
                p["datasource"]["uid"], "${datasource}",
                "panel {} uses the dashboard's datasource variable",
                p["title"]
            );
            let targets = p["targets"].as_array().expect("targets");
            assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        }
    }

    // The panels the operations guide describes, by the query they must run.
    let panel_exprs = |title: &str| -> Vec<String> {
        let p = all
            .iter()
            .find(|p| p["title"] == title)
            .unwrap_or_else(|| panic!("no panel titled {title:?}"));
        p["targets"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["expr"].as_str().unwrap().to_owned())
            .collect()
    };
    let has = |title: &str, needle: &str| {
        assert!(
            panel_exprs(title).iter().any(|e| e.contains(needle)),
            "panel {title:?} should query {needle}"
        );
    };
    has(
        "Lag: oldest ready, waiting and unsent",
        "outbox_oldest_ready_age_seconds",
    );
    has(
        "Lag: oldest ready, waiting and unsent",
        "outbox_oldest_waiting_age_seconds",
    );
    has("Lag", "outbox_oldest_ready_age_seconds");
    has(
        "Table health: dead tuples and relay vacuums",
        "outbox_table_dead_tuples",
    );
    has(
        "Pending: ready vs waiting",
        "max by (outbox, state) (outbox_pending_messages",
    );
    has(
        "Throughput by outbox",
        "sum by (outbox) (rate(outbox_published_total",
    );

    // The outbox selector: a multi-value variable over the `outbox` label, and every query of
    // a per-table metric (all but the process-wide ones) filters by it.
    let vars = d["templating"]["list"].as_array().unwrap();
    let outbox = vars
        .iter()
        .find(|v| v["name"] == "outbox")
        .expect("an `outbox` template variable");
    assert!(
        outbox["query"]["query"]
            .as_str()
            .unwrap()
            .starts_with("label_values(outbox_")
            && outbox["query"]["query"]
                .as_str()
                .unwrap()
                .ends_with(", outbox)"),
        "{outbox}"
    );
    assert_eq!(outbox["multi"], true);
    assert_eq!(outbox["includeAll"], true);
    for p in &all {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            let process_wide = ["outbox_relay_info", "outbox_broker_connected", "up{"]
                .iter()
                .any(|m| expr.contains(m));
            if !process_wide {
                assert_eq!(
                    expr.matches('{').count(),
                    expr.matches("outbox=~\"$outbox\"").count(),
                    "panel {}: every selector filters by $outbox: {expr}",
                    p["title"]
                );
            }
        }
    }
    has(
        "Throughput by aggregate type",
        "sum by (aggregate_type) (rate(outbox_published_total",
    );
    has(
        "Publish failures by kind",
        "sum by (kind) (rate(outbox_publish_failures_total",
    );
    has("Dead letters and newly failed", "outbox_failed_messages");
    has(
        "Dead letters and newly failed",
        "rate(outbox_dead_lettered_total",
    );
    has("Blocked aggregates over time", "outbox_blocked_aggregates");
    has("Expired (never published)", "rate(outbox_expired_total");
    has(
        "Watermark lag (ordering guard)",
        "outbox_watermark_lag_seconds",
    );
    has("Claim batch size", "outbox_claim_batch_size_bucket");
    has("Broker connection by relay", "outbox_broker_connected");
    for (title, metric) in [
        (
            "End-to-end latency (created_at → confirmed)",
            "outbox_end_to_end_latency_seconds_bucket",
        ),
        (
            "Publish duration (send → confirm)",
            "outbox_publish_duration_seconds_bucket",
        ),
    ] {
        let exprs = panel_exprs(title);
        for q in ["0.5", "0.95", "0.99"] {
            assert!(
                exprs
                    .iter()
                    .any(|e| e.starts_with(&format!("histogram_quantile({q},"))
                        && e.contains(metric)),
                "{title} shows p{q} of {metric}"
            );
        }
    }
}

// ---- Prometheus rules -------------------------------------------------------------------------

/// (alert name, expr) of every alerting rule in alerts.yml.
fn alert_rules() -> Vec<(String, String)> {
    let rules = yaml(&deploy("prometheus/alerts.yml"));
    let mut out = Vec::new();
    for group in at(&rules, &["groups"]).as_sequence().unwrap() {
        for rule in at(group, &["rules"]).as_sequence().unwrap() {
            out.push((
                s(rule, &["alert"]).to_owned(),
                s(rule, &["expr"]).to_owned(),
            ));
        }
    }
    out
}

#[test]
fn alert_rules_name_known_metrics_and_each_has_both_unit_test_cases() {
    let rules = alert_rules();
    let alert_names: BTreeSet<&str> = rules.iter().map(|(n, _)| n.as_str()).collect();
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
    let exprs: Vec<String> = rules.iter().map(|(_, e)| e.clone()).collect();
    let used = assert_known_metrics("alerts.yml", &exprs);
    for needed in [
        names::OLDEST_READY_AGE,
        names::FAILED,
        names::BLOCKED_AGGREGATES,
        names::PUBLISHED,
        names::PENDING,
        names::BROKER_CONNECTED,
    ] {
        assert!(used.contains(needed), "no alert watches {needed}");
    }

    // Every alert has a test case where it fires and one where it does not.
    let tests = yaml(&deploy("prometheus/alerts.test.yml"));
    let mut firing: BTreeSet<String> = BTreeSet::new();
    let mut silent: BTreeSet<String> = BTreeSet::new();
    for case in at(&tests, &["tests"]).as_sequence().unwrap() {
        for t in at(case, &["alert_rule_test"]).as_sequence().unwrap() {
            let name = s(t, &["alertname"]).to_owned();
            let expected = at(t, &["exp_alerts"]).as_sequence().unwrap();
            if expected.is_empty() {
                silent.insert(name);
            } else {
                firing.insert(name);
            }
        }
    }
    for name in &alert_names {
        assert!(firing.contains(*name), "no unit test where {name} fires");
        assert!(
            silent.contains(*name),
            "no unit test where {name} stays silent"
        );
    }
}

fn promtool(args: &[&str]) {
    let out = match Command::new("promtool")
        .args(args)
        .current_dir(deploy("prometheus"))
        .output()
    {
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
