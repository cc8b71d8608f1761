//! A real Chromium for the console's tests: `chromedriver` (Debian's `chromium-driver`) on a
//! free loopback port and a headless session on it, driven over WebDriver with `fantoccini`.
//! `scripts/services.sh` installs Debian's `chromium` and `chromium-driver` when they are
//! missing.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

pub use fantoccini::elements::Element;
pub use fantoccini::key::Key;
pub use fantoccini::{Client, Locator};

use fantoccini::ClientBuilder;
use fantoccini::wd::WebDriverCompatibleCommand;
use serde_json::{Value, json};
use tokio::process::{Child, Command};

use crate::{TempDir, free_port, wait_until};

/// The Chromium binary: `$CHROME_BIN`, else Debian's `/usr/bin/chromium`.
pub fn chromium_bin() -> PathBuf {
    std::env::var_os("CHROME_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromium"))
}

/// The driver: `$CHROMEDRIVER`, else Debian's `/usr/bin/chromedriver`.
pub fn chromedriver_bin() -> PathBuf {
    std::env::var_os("CHROMEDRIVER")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/chromedriver"))
}

/// A headless Chromium session and its own chromedriver (both end when this is dropped).
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
    driver: Child,
    _profile: TempDir,
}

/// A Chrome DevTools Protocol command sent through chromedriver (`goog/cdp/execute`): what
/// WebDriver has no command for (the emulated colour scheme, a viewport narrower than the
/// smallest window headless Chromium opens).
#[derive(Debug)]
struct Cdp {
    cmd: &'static str,
    params: Value,
}

impl WebDriverCompatibleCommand for Cdp {
    fn endpoint(
        &self,
        base_url: &url::Url,
        session_id: Option<&str>,
    ) -> Result<url::Url, url::ParseError> {
        base_url.join(&format!(
            "session/{}/goog/cdp/execute",
            session_id.unwrap_or_default()
        ))
    }

    fn method_and_body(&self, _request_url: &url::Url) -> (http::Method, Option<String>) {
        let body = json!({ "cmd": self.cmd, "params": self.params });
        (http::Method::POST, Some(body.to_string()))
    }
}

impl Browser {
    /// Starts chromedriver and a headless session with a 1280×900 window; panics saying what
    /// to install when Chromium or its driver is missing.
    pub async fn start() -> Self {
        let (width, height) = (1280, 900);
        let (chromium, driver_bin) = (chromium_bin(), chromedriver_bin());
        for bin in [&chromium, &driver_bin] {
            assert!(
                bin.exists(),
                "{} is missing: install Debian's chromium and chromium-driver (scripts/services.sh does)",
                bin.display()
            );
        }
        let port = free_port();
        let driver = Command::new(&driver_bin)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", driver_bin.display()));
        let url = format!("http://127.0.0.1:{port}");
        let profile = TempDir::new("chromium");
        let mut caps = serde_json::Map::new();
        caps.insert("browserName".into(), json!("chrome"));
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": chromium.to_string_lossy(),
                "args": [
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    "--disable-extensions",
                    "--no-first-run",
                    "--hide-scrollbars",
                    "--force-device-scale-factor=1",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", profile.path().display()),
                ],
            }),
        );
        let client = wait_until(
            Duration::from_secs(60),
            "chromedriver starts a headless Chromium session",
            async || {
                ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new())
                    .capabilities(caps.clone())
                    .connect(&url)
                    .await
                    .map_err(|e| e.to_string())
            },
        )
        .await;
        Self {
            client,
            driver,
            _profile: profile,
        }
    }

    /// Opens `url` and waits until the page has loaded.
    pub async fn goto(&self, url: &str) {
        self.client
            .goto(url)
            .await
            .unwrap_or_else(|e| panic!("open {url}: {e}"));
    }

    /// The first element matching `css`; panics naming it when there is none.
    pub async fn find(&self, css: &str) -> Element {
        self.client
            .find(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("no element {css:?} in the page: {e}"))
    }

    /// Every element matching `css`.
    pub async fn find_all(&self, css: &str) -> Vec<Element> {
        self.client
            .find_all(Locator::Css(css))
            .await
            .unwrap_or_else(|e| panic!("find {css:?}: {e}"))
    }

    /// The visible text of the first element matching `css` (`None` when there is none).
    pub async fn text(&self, css: &str) -> Option<String> {
        let el = self.client.find(Locator::Css(css)).await.ok()?;
        el.text().await.ok()
    }

    /// Runs `script` (a function body; `arguments` holds `args`) and returns its value.
    pub async fn eval(&self, script: &str, args: Vec<Value>) -> Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|e| panic!("script failed: {e}\n{script}"))
    }

    async fn cdp(&self, cmd: &'static str, params: Value) {
        self.client
            .issue_cmd(Cdp { cmd, params })
            .await
            .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    }

    /// Makes the page's viewport `width`×`height` CSS pixels (a phone's below 600 px wide),
    /// whatever the window's size.
    pub async fn viewport(&self, width: u32, height: u32) {
        let params = json!({
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": width < 600,
        });
        self.cdp("Emulation.setDeviceMetricsOverride", params).await;
    }

    /// Emulates `prefers-color-scheme: dark` (`true`) or `light`.
    pub async fn dark(&self, dark: bool) {
        let scheme = if dark { "dark" } else { "light" };
        let features = json!({ "features": [{ "name": "prefers-color-scheme", "value": scheme }] });
        self.cdp("Emulation.setEmulatedMedia", features).await;
    }

    /// A PNG of the whole page `width` pixels wide: the viewport is made as tall as the page
    /// for the shot, then set back to `height`.
    pub async fn screenshot_page(&self, width: u32, height: u32) -> Vec<u8> {
        self.viewport(width, height).await;
        let tall = self
            .eval(
                "return Math.ceil(document.documentElement.scrollHeight);",
                vec![],
            )
            .await
            .as_u64()
            .unwrap_or(u64::from(height));
        let tall = u32::try_from(tall).unwrap_or(height).max(height);
        self.viewport(width, tall).await;
        let png = self
            .client
            .screenshot()
            .await
            .unwrap_or_else(|e| panic!("screenshot: {e}"));
        self.viewport(width, height).await;
        png
    }

    /// Ends the session and the driver.
    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill().await;
    }
}
