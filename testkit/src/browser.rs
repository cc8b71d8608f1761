//! A real Chromium for the console's tests: a headless Chromium started here, `chromedriver`
//! (Debian's `chromium-driver`) on a free loopback port attached to it, driven over WebDriver
//! with `fantoccini`. The kit starts the browser itself (rather than letting the driver do it)
//! so that both end with the [`Browser`], also when a test panics before closing it.
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

/// How long the browser and its driver may take to start.
const WAIT: Duration = Duration::from_secs(60);

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

/// A headless Chromium, its own chromedriver and a WebDriver session (all end when this is
/// dropped).
pub struct Browser {
    /// The WebDriver session.
    pub client: Client,
    driver: Child,
    chromium: Child,
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
        let profile = TempDir::new("chromium");
        let chromium = Command::new(&chromium)
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--disable-extensions",
                "--no-first-run",
                "--no-default-browser-check",
                "--hide-scrollbars",
                "--force-device-scale-factor=1",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
            ])
            .arg(format!("--window-size={width},{height}"))
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromium.display()));
        // Chromium writes the DevTools port it chose into its profile.
        let active = profile.path().join("DevToolsActivePort");
        let devtools = wait_until(WAIT, "Chromium opens its DevTools port", async || {
            let text = std::fs::read_to_string(&active).map_err(|e| e.to_string())?;
            let port = text.lines().next().unwrap_or_default().trim();
            port.parse::<u16>().map_err(|e| format!("{port:?}: {e}"))
        })
        .await;
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
        let mut caps = serde_json::Map::new();
        caps.insert("browserName".into(), json!("chrome"));
        caps.insert(
            "goog:chromeOptions".into(),
            json!({ "debuggerAddress": format!("127.0.0.1:{devtools}") }),
        );
        let client = wait_until(
            WAIT,
            "chromedriver attaches a session to the headless Chromium",
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
            chromium,
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

    /// Ends the session, the driver and the browser.
    pub async fn close(mut self) {
        let _ = self.client.clone().close().await;
        let _ = self.driver.kill().await;
        let _ = self.chromium.kill().await;
    }
}
