//! `[console]`: the web console that `metrics.listen` serves at `/` (docs/console.md): whether
//! it is on, whether it may change dead letters (and the token those changes need), and
//! whether it shows payloads and headers.

use serde::{Deserialize, Serialize};

use super::{ConfigError, Secret};

/// The environment variable that may hold `console.token`, read as is (figment would parse a
/// token that looks like a number, and echo it in its error).
pub const CONSOLE_TOKEN_ENV: &str = "RELAY_CONSOLE__TOKEN";

/// The shortest `console.token` accepted, in characters: a token that guards retry and
/// discard should not be guessable.
pub const MIN_CONSOLE_TOKEN_CHARS: usize = 16;

/// `[console]` as written.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawConsole {
    /// Serve the console at `/` of `metrics.listen` (default true; the metrics and health
    /// endpoints stay either way).
    pub enabled: bool,
    /// Let the console retry and discard dead letters (default false: read-only). Needs
    /// `token`.
    pub allow_actions: bool,
    /// The bearer token that every retry or discard must carry (`Authorization: Bearer
    /// <token>`); at least 16 characters. Best given as `RELAY_CONSOLE__TOKEN`. Never printed.
    pub token: Option<Secret>,
    /// Show payloads and headers (default true; false for events that carry personal data).
    pub show_payloads: bool,
}

impl Default for RawConsole {
    fn default() -> Self {
        Self {
            enabled: true,
            allow_actions: false,
            token: None,
            show_payloads: true,
        }
    }
}

/// The validated `[console]`.
#[derive(Clone, PartialEq, Eq)]
pub struct ConsoleConfig {
    /// Serve the console.
    pub enabled: bool,
    /// The token that retry and discard need; `None`: the console is read-only (actions are
    /// allowed only when `allow_actions` and a token are both set).
    pub actions_token: Option<Secret>,
    /// Show payloads and headers.
    pub show_payloads: bool,
    /// `allow_actions` is set but no token is: an error for `run` and `check`
    /// ([`ConsoleConfig::ready_to_serve`]), not for the commands that serve no console (the
    /// token is often given to the daemon's environment only).
    pub actions_without_token: bool,
}

impl ConsoleConfig {
    /// The error of a console that asks for actions without a token, for the commands that
    /// serve it (`run`) or vouch for it (`check`).
    pub fn ready_to_serve(&self) -> Result<(), ConfigError> {
        if self.actions_without_token {
            return Err(ConfigError::invalid(
                "console.allow_actions",
                format!(
                    "is true but console.token is not set: retry and discard need a token (set console.token, or {CONSOLE_TOKEN_ENV}), or set console.allow_actions = false"
                ),
            ));
        }
        Ok(())
    }
}

impl std::fmt::Debug for ConsoleConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleConfig")
            .field("enabled", &self.enabled)
            .field("actions", &self.actions_token.is_some())
            .field("show_payloads", &self.show_payloads)
            .finish()
    }
}

impl Default for ConsoleConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            actions_token: None,
            show_payloads: true,
            actions_without_token: false,
        }
    }
}

impl RawConsole {
    /// Checks the section: actions need a token, and a token must be long enough.
    pub(super) fn validate(self) -> Result<ConsoleConfig, ConfigError> {
        if let Some(token) = &self.token {
            // Counted without surrounding blanks, as a request's token is compared.
            let chars = token.0.trim().chars().count();
            if chars < MIN_CONSOLE_TOKEN_CHARS {
                // Never echo the token: only its length and what is expected.
                return Err(ConfigError::invalid(
                    "console.token",
                    format!(
                        "is {chars} characters without its surrounding blanks; at least {MIN_CONSOLE_TOKEN_CHARS} are required (e.g. the output of `openssl rand -hex 24`); the value is not shown"
                    ),
                ));
            }
        }
        let actions_without_token = self.allow_actions && self.token.is_none();
        // A token alone changes nothing: the console stays read-only (and so it is, if only
        // as a fallback, with actions asked for and no token).
        let actions_token = self.token.filter(|_| self.allow_actions);
        Ok(ConsoleConfig {
            enabled: self.enabled,
            actions_token,
            show_payloads: self.show_payloads,
            actions_without_token,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err_has, load_str};
    use super::*;

    const TOKEN: &str = "s3cret-console-token-0123";

    #[test]
    fn defaults_are_on_read_only_with_payloads() {
        let c = load_str("", &[]).unwrap().console;
        assert_eq!(c, ConsoleConfig::default());
        assert!(c.enabled && c.show_payloads && c.actions_token.is_none());
    }

    #[test]
    fn actions_need_a_token_from_the_file_or_the_environment() {
        // Loaded (the operator's commands serve no console), but not ready to serve it.
        let c = load_str("[console]\nallow_actions = true\n", &[])
            .unwrap()
            .console;
        assert_eq!(c.actions_token, None, "read-only without a token");
        let e = c.ready_to_serve().unwrap_err().to_string();
        assert!(
            e.starts_with(
                "invalid value for console.allow_actions: is true but console.token is not set"
            ),
            "{e}"
        );
        let c = load_str(
            &format!("[console]\nallow_actions = true\ntoken = \"{TOKEN}\"\n"),
            &[],
        )
        .unwrap()
        .console;
        assert_eq!(c.actions_token, Some(Secret(TOKEN.into())));
        assert!(c.ready_to_serve().is_ok());
        // From the environment, read as is: digits stay text.
        let digits = "1".repeat(20);
        let c = load_str(
            "[console]\nallow_actions = true\n",
            &[("CONSOLE__TOKEN", digits.as_str())],
        )
        .unwrap()
        .console;
        assert_eq!(c.actions_token, Some(Secret(digits)));
        // A token without allow_actions leaves the console read-only.
        let c = load_str(&format!("[console]\ntoken = \"{TOKEN}\"\n"), &[])
            .unwrap()
            .console;
        assert_eq!(c.actions_token, None);
    }

    #[test]
    fn a_short_token_is_rejected_without_showing_it() {
        err_has(
            "[console]\nallow_actions = true\ntoken = \"hunter2\"\n",
            &["console.token", "7 characters", "at least 16"],
            &["hunter2"],
        );
        let blanks = " ".repeat(20);
        err_has(
            &format!("[console]\nallow_actions = true\ntoken = \"{blanks}\"\n"),
            &[
                "console.token",
                "is 0 characters without its surrounding blanks",
            ],
            &[],
        );
        err_has("[console]\nenable = false\n", &["enable"], &[]);
        // A token that is not a string: figment would quote it in its error.
        err_has(
            "[console]\ntoken = 123456789012345678\n",
            &["console.token"],
            &["123456789012345678"],
        );
    }

    #[test]
    fn debug_output_never_shows_the_token() {
        let c = load_str(
            &format!("[console]\nallow_actions = true\ntoken = \"{TOKEN}\"\n"),
            &[],
        )
        .unwrap();
        let shown = format!("{c:?}");
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(shown.contains("actions: true"), "{shown}");
        let raw = RawConsole {
            token: Some(Secret(TOKEN.into())),
            ..RawConsole::default()
        };
        assert!(!format!("{raw:?}").contains(TOKEN));
    }

    #[test]
    fn the_console_can_be_turned_off_and_payloads_hidden() {
        let c = load_str("[console]\nenabled = false\nshow_payloads = false\n", &[])
            .unwrap()
            .console;
        assert!(!c.enabled && !c.show_payloads);
    }
}
