//! `[signing]`: the HMAC key that signs every message (`outbox-signature`), never shown in
//! logs or errors.

use serde::{Deserialize, Deserializer, Serialize};

use super::ConfigError;

/// A secret as written (`signing.key`): its `Debug` never shows it.
#[derive(Clone, Serialize, Deserialize, PartialEq, Eq)]
#[serde(transparent)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("\"<redacted>\"")
    }
}

/// A string that may have been written as a number: the environment provider parses
/// `RELAY_SIGNING__KEY_ID=2026` as an integer.
fn text_or_number<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum TextOrNumber {
        Text(String),
        Unsigned(u64),
        Signed(i64),
    }
    Ok(Option::<TextOrNumber>::deserialize(d)?.map(|v| match v {
        TextOrNumber::Text(s) => s,
        TextOrNumber::Unsigned(n) => n.to_string(),
        TextOrNumber::Signed(n) => n.to_string(),
    }))
}

/// `[signing]` as written. Both keys or neither: without them messages are not signed.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawSigning {
    /// Key id written into every signature (`kid=`), so consumers know which key to check.
    #[serde(default, deserialize_with = "text_or_number")]
    pub key_id: Option<String>,
    /// HMAC-SHA256 key: at least 32 bytes; `base64:<standard base64>` or `whsec_<standard
    /// base64>` (a Standard Webhooks secret) for binary keys. Best
    /// given as `RELAY_SIGNING__KEY` rather than in the file.
    pub key: Option<Secret>,
}

/// The validated `[signing]` section: sign every message with this key.
#[derive(Clone)]
pub struct SigningConfig {
    /// Key id (letters, digits, `.`, `_`, `-`, `:`; at most 64).
    pub key_id: String,
    /// Key bytes (at least 32). Never logged: `Debug` shows only the length.
    pub key: Vec<u8>,
}

impl std::fmt::Debug for SigningConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SigningConfig")
            .field("key_id", &self.key_id)
            .field("key", &format_args!("<{} bytes, redacted>", self.key.len()))
            .finish()
    }
}

/// The smallest signing key accepted, in bytes (HMAC-SHA256's output size).
pub const MIN_SIGNING_KEY_BYTES: usize = 32;

/// The prefix of a `signing.key` written as standard base64.
pub const BASE64_PREFIX: &str = "base64:";

/// The prefix of a `signing.key` written as a Standard Webhooks secret (`whsec_<base64>`).
pub const WHSEC_PREFIX: &str = "whsec_";

/// The environment variable that may hold `signing.key`, read as is (figment would parse a
/// key that looks like a number or a list, and echo it in its error).
pub const SIGNING_KEY_ENV: &str = "RELAY_SIGNING__KEY";

impl RawSigning {
    /// Checks the section: `None` when signing is off.
    pub(super) fn validate(self) -> Result<Option<SigningConfig>, ConfigError> {
        let (key_id, key) = match (self.key_id, self.key) {
            (None, None) => return Ok(None),
            (Some(_), None) => {
                return Err(ConfigError::invalid(
                    "signing.key",
                    format!(
                        "must be set when signing.key_id is (in the file or as {SIGNING_KEY_ENV})"
                    ),
                ));
            }
            (None, Some(_)) => {
                return Err(ConfigError::invalid(
                    "signing.key_id",
                    "must be set when signing.key is (consumers pick the verification key by it)",
                ));
            }
            (Some(id), Some(key)) => (id, key),
        };
        let id_ok = !key_id.is_empty()
            && key_id.len() <= 64
            && key_id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | ':'));
        if !id_ok {
            return Err(ConfigError::invalid(
                "signing.key_id",
                format!(
                    "{key_id:?} is not 1 to 64 of letters, digits, '.', '_', '-', ':' (it goes into the header as kid=...)"
                ),
            ));
        }
        let bytes = key_bytes(key.0)?;
        if bytes.len() < MIN_SIGNING_KEY_BYTES {
            return Err(ConfigError::invalid(
                "signing.key",
                format!(
                    "is {} bytes; at least {MIN_SIGNING_KEY_BYTES} are required (e.g. \"base64:\" followed by the output of `openssl rand -base64 32`)",
                    bytes.len()
                ),
            ));
        }
        Ok(Some(SigningConfig { key_id, key: bytes }))
    }
}

/// The key's bytes: `base64:` or `whsec_` and standard base64, or the text itself. An error
/// never shows the key.
fn key_bytes(key: String) -> Result<Vec<u8>, ConfigError> {
    // Never echo the key in an error: only its length and what is expected.
    // `whsec_<base64>` is how Standard Webhooks libraries write a secret: the same bytes.
    let encoded = [BASE64_PREFIX, WHSEC_PREFIX]
        .into_iter()
        .find_map(|prefix| Some((prefix, key.strip_prefix(prefix)?)));
    match encoded {
        Some((prefix, b64)) => {
            use base64::Engine;
            base64::engine::general_purpose::STANDARD
                .decode(b64.trim())
                .map_err(|_| {
                    ConfigError::invalid(
                        "signing.key",
                        format!("the text after {prefix:?} is not standard base64 (A-Z, a-z, 0-9, '+', '/', padded with '='); the value is not shown"),
                    )
                })
        }
        None => Ok(key.into_bytes()),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{err_has, load_str};
    use super::*;

    const KEY32: &str = "0123456789abcdef0123456789abcdef";

    #[test]
    fn signing_is_off_by_default_and_takes_text_or_base64_keys() {
        assert!(load_str("", &[]).unwrap().signing.is_none());
        let c = load_str(
            &format!("[signing]\nkey_id = \"k-2026.1\"\nkey = \"{KEY32}\"\n"),
            &[],
        )
        .unwrap();
        let s = c.signing.unwrap();
        assert_eq!(
            (s.key_id.as_str(), s.key.as_slice()),
            ("k-2026.1", KEY32.as_bytes())
        );
        // 32 zero bytes in base64, from the environment (read as is, never parsed).
        let b64 = format!("base64:{}", "A".repeat(43) + "=");
        let c = load_str(
            "[signing]\nkey_id = \"k2\"\n",
            &[("SIGNING__KEY", b64.as_str())],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key, vec![0u8; 32]);
        // A Standard Webhooks secret: the bytes of its base64.
        let whsec = "whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=";
        let c = load_str(
            &format!("[signing]\nkey_id = \"k4\"\nkey = \"{whsec}\"\n"),
            &[],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key, (0u8..32).collect::<Vec<u8>>());
        // A numeric key id from the environment is a key id.
        let c = load_str(
            &format!("[signing]\nkey = \"{KEY32}\"\n"),
            &[("SIGNING__KEY_ID", "2026")],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key_id, "2026");
        // A key of digits only stays text.
        let digits = "1".repeat(40);
        let c = load_str(
            "[signing]\nkey_id = \"k3\"\n",
            &[("SIGNING__KEY", digits.as_str())],
        )
        .unwrap();
        assert_eq!(c.signing.unwrap().key, digits.as_bytes());
    }

    #[test]
    fn signing_rejections_name_the_key_and_never_show_it() {
        let short = "hunter2-short-key";
        let signing = |body: &str| format!("[signing]\n{body}\n");
        let key = |k: &str| signing(&format!("key_id = \"k\"\nkey = \"{k}\""));
        err_has(&key(short), &["signing.key", "17 bytes"], &[short]);
        let not_base64 = "base64:hunter2!!not*base64";
        err_has(&key(not_base64), &["signing.key", "base64"], &["hunter2"]);
        let not_whsec = "whsec_hunter2!!not*base64";
        err_has(&key(not_whsec), &["signing.key", "whsec_"], &["hunter2"]);
        // 24 bytes, as some webhook platforms generate: below the minimum.
        let short_whsec = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
        err_has(
            &key(short_whsec),
            &["signing.key", "24 bytes"],
            &["MfKQ9r8"],
        );
        let no_id = signing(&format!("key = \"{KEY32}\""));
        err_has(&no_id, &["signing.key_id"], &[KEY32]);
        err_has(&signing("key_id = \"k\""), &["signing.key"], &[]);
        let bad_id = signing(&format!("key_id = \"a;b\"\nkey = \"{KEY32}\""));
        err_has(&bad_id, &["signing.key_id"], &[KEY32]);
        // A key that is not a string: figment would quote it in its error.
        let number = signing("key_id = \"k\"\nkey = 12345678901234567");
        err_has(&number, &["signing.key"], &["12345678901234567"]);
        err_has(&signing("key_idd = \"k\""), &["key_idd"], &[]);
    }

    #[test]
    fn debug_output_never_shows_the_signing_key() {
        let c = load_str(
            &format!("[signing]\nkey_id = \"k\"\nkey = \"{KEY32}\"\n"),
            &[],
        )
        .unwrap();
        let shown = format!("{c:?}");
        assert!(
            !shown.contains(KEY32) && shown.contains("32 bytes, redacted"),
            "{shown}"
        );
        let raw = RawSigning {
            key_id: Some("k".into()),
            key: Some(Secret(KEY32.into())),
        };
        assert!(!format!("{raw:?}").contains(KEY32));
    }
}
