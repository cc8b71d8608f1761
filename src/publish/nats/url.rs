//! `publisher.nats.url`: the server address and the credentials it may carry, taken apart
//! once (async-nats does not read credentials from a URL), and its redaction for logs.

use async_nats::ConnectOptions;

/// Credentials found in the URL's userinfo.
#[derive(Clone, PartialEq, Eq)]
pub enum Credentials {
    /// No userinfo.
    None,
    /// `user:password@`.
    UserPassword(String, String),
    /// `token@` (a userinfo without a password is a token, as the NATS tools read it).
    Token(String),
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::None => f.write_str("None"),
            Self::UserPassword(user, _) => write!(f, "UserPassword({user:?}, ***)"),
            Self::Token(_) => f.write_str("Token(***)"),
        }
    }
}

/// A validated server URL: the address to dial (without credentials) and the credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerUrl {
    /// `nats://host:port` or `tls://host:port`.
    pub address: String,
    /// What the userinfo held.
    pub credentials: Credentials,
}

impl ServerUrl {
    /// Parses `raw`; the error says what is wrong and shows the URL redacted.
    pub fn parse(raw: &str) -> Result<Self, String> {
        let shown = redact(raw);
        let url = url::Url::parse(raw.trim())
            .map_err(|e| format!("{shown} is not a URL ({e}); write nats://host:4222"))?;
        if !matches!(url.scheme(), "nats" | "tls") {
            return Err(format!("{shown} must start with nats:// or tls://"));
        }
        let host = match url.host_str() {
            Some(h) if !h.is_empty() => h.to_owned(),
            _ => return Err(format!("{shown} has no host")),
        };
        if url.path().len() > 1 || url.query().is_some() {
            return Err(format!(
                "{shown} has a path or query, which NATS does not use (write scheme://[credentials@]host:port)"
            ));
        }
        let decode = |s: &str| {
            percent_decode(s).ok_or_else(|| format!("{shown} has credentials that are not UTF-8"))
        };
        let credentials = match (url.username(), url.password()) {
            ("", None) => Credentials::None,
            (user, Some(pass)) => Credentials::UserPassword(decode(user)?, decode(pass)?),
            (token, None) => Credentials::Token(decode(token)?),
        };
        let port = url.port().unwrap_or(4222);
        Ok(Self {
            address: format!("{}://{host}:{port}", url.scheme()),
            credentials,
        })
    }

    /// `options` with these credentials.
    pub fn authenticate(&self, options: ConnectOptions) -> ConnectOptions {
        match &self.credentials {
            Credentials::None => options,
            Credentials::UserPassword(user, pass) => {
                options.user_and_password(user.clone(), pass.clone())
            }
            Credentials::Token(token) => options.token(token.clone()),
        }
    }
}

fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && let Some(hex) = s.get(i + 1..i + 3)
            && let Ok(b) = u8::from_str_radix(hex, 16)
        {
            out.push(b);
            i += 3;
            continue;
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// `raw` with its secret masked: the password of `user:password@`, or the whole userinfo when
/// it is a token (`token@`).
pub fn redact(raw: &str) -> String {
    let Some(scheme_end) = raw.find("://") else {
        return crate::redact::redact_url(raw);
    };
    let (head, tail) = raw.split_at(scheme_end + 3);
    let authority_end = tail.find(['/', '?', '#']).unwrap_or(tail.len());
    let (authority, rest) = tail.split_at(authority_end);
    match authority.rfind('@') {
        Some(at) => {
            let (userinfo, host) = authority.split_at(at);
            let masked = match userinfo.split_once(':') {
                Some((user, _)) => format!("{user}:***"),
                None => "***".to_owned(),
            };
            format!("{head}{masked}{host}{rest}")
        }
        None => raw.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn credentials_are_taken_from_the_url() {
        let u = ServerUrl::parse("nats://app:p%40ss@127.0.0.1:4223").unwrap();
        assert_eq!(u.address, "nats://127.0.0.1:4223");
        assert_eq!(
            u.credentials,
            Credentials::UserPassword("app".into(), "p@ss".into())
        );
        let t = ServerUrl::parse("tls://s3cr3t@nats.example").unwrap();
        assert_eq!(t.address, "tls://nats.example:4222");
        assert_eq!(t.credentials, Credentials::Token("s3cr3t".into()));
        assert!(!format!("{t:?}{u:?}").contains("s3cr3t"));
        assert!(!format!("{u:?}").contains("p@ss"));
        let plain = ServerUrl::parse("nats://127.0.0.1:4222").unwrap();
        assert_eq!(plain.credentials, Credentials::None);
    }

    #[test]
    fn bad_urls_are_explained_without_their_secrets() {
        for (raw, says) in [
            ("http://u:hunter2@x:4222", "must start with nats://"),
            ("127.0.0.1:4222", "nats://"),
            ("nats://hunter2@", "host"),
            ("nats://x:4222/path", "path"),
        ] {
            let e = ServerUrl::parse(raw).unwrap_err();
            assert!(e.contains(says), "{raw}: {e}");
            assert!(!e.contains("hunter2"), "{raw}: {e}");
        }
    }

    #[test]
    fn redaction_masks_passwords_and_tokens() {
        assert_eq!(redact("nats://u:pw@h:1"), "nats://u:***@h:1");
        assert_eq!(redact("nats://tok@h:1"), "nats://***@h:1");
        assert_eq!(redact("nats://h:1"), "nats://h:1");
    }
}
