//! Redaction of secrets in connection strings before they reach a log line or an error.

/// Replaces the password of a URL (`scheme://user:pass@host`) or of a libpq key/value string
/// (`password=...`) with `***`. Anything that cannot be parsed is returned with every
/// `user:pass@` userinfo masked as a precaution.
pub fn redact_url(raw: &str) -> String {
    if raw.contains("://") {
        return redact_userinfo(raw, Userinfo::User);
    }
    redact_keyword_password(raw)
}

/// As [`redact_url`], for URLs whose userinfo is a credential even without a password (an
/// HTTP endpoint's `https://APIKEY@host/`): a userinfo without `:` is masked whole, as `***@`;
/// `user:pass@` still shows its user, as `user:***@`.
pub fn redact_url_tokens(raw: &str) -> String {
    if raw.contains("://") {
        return redact_userinfo(raw, Userinfo::Token);
    }
    redact_keyword_password(raw)
}

/// What a userinfo without `:` is: a user name (shown) or a token (masked).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Userinfo {
    User,
    Token,
}

/// Where the next URL of a comma-separated list begins in `s`: the first `,` followed by a
/// scheme (`nats://`). A comma followed by anything else belongs to the URL before it (a
/// password may hold one).
pub fn next_url_in_list(s: &str) -> Option<usize> {
    s.match_indices(',').map(|(i, _)| i).find(|&i| {
        let after = &s[i + 1..];
        after.find("://").is_some_and(|end| {
            let scheme = &after[..end];
            scheme.starts_with(|c: char| c.is_ascii_alphabetic())
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+-.".contains(c))
        })
    })
}

fn redact_userinfo(raw: &str, bare: Userinfo) -> String {
    // Works on comma-separated broker lists too: each `user:pass@` is masked.
    let mut out = String::with_capacity(raw.len());
    let mut rest = raw;
    while let Some(scheme_end) = rest.find("://") {
        let (head, tail) = rest.split_at(scheme_end + 3);
        out.push_str(head);
        let path = tail.find(['/', '?', '#']).unwrap_or(tail.len());
        let authority_end = next_url_in_list(tail).map_or(path, |next| next.min(path));
        let authority = &tail[..authority_end];
        match authority.rfind('@') {
            Some(at) => {
                let userinfo = &authority[..at];
                match userinfo.find(':') {
                    Some(colon) => {
                        out.push_str(&userinfo[..colon]);
                        out.push_str(":***");
                    }
                    None if bare == Userinfo::Token => out.push_str("***"),
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[authority_end..];
    }
    out.push_str(rest);
    redact_query_password(&out)
}

fn redact_query_password(s: &str) -> String {
    // `?password=...` in a URL's query string.
    let mut out = String::with_capacity(s.len());
    let mut rest = s;
    while let Some(pos) = rest.find("password=") {
        let boundary_ok = pos == 0 || matches!(rest.as_bytes()[pos - 1], b'?' | b'&' | b' ');
        out.push_str(&rest[..pos + "password=".len()]);
        rest = &rest[pos + "password=".len()..];
        if boundary_ok {
            let end = rest.find(['&', ' ', '#']).unwrap_or(rest.len());
            out.push_str("***");
            rest = &rest[end..];
        }
    }
    out.push_str(rest);
    out
}

fn redact_keyword_password(s: &str) -> String {
    s.split(' ')
        .map(|part| match part.split_once('=') {
            Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
            _ => part.to_owned(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::{redact_url, redact_url_tokens};

    #[test]
    fn masks_url_password() {
        assert_eq!(
            redact_url("postgres://app:s3cret@db:5432/test"),
            "postgres://app:***@db:5432/test"
        );
        assert_eq!(
            redact_url("amqp://guest:guest@127.0.0.1:5672/%2f"),
            "amqp://guest:***@127.0.0.1:5672/%2f"
        );
    }

    #[test]
    fn leaves_urls_without_password() {
        assert_eq!(
            redact_url("postgres://postgres@127.0.0.1/test"),
            "postgres://postgres@127.0.0.1/test"
        );
        assert_eq!(redact_url("amqp://127.0.0.1"), "amqp://127.0.0.1");
    }

    #[test]
    fn masks_password_with_at_sign_and_query() {
        assert_eq!(
            redact_url("postgres://u:p@ss@h/db?password=x&sslmode=require"),
            "postgres://u:***@h/db?password=***&sslmode=require"
        );
    }

    #[test]
    fn a_comma_in_a_password_is_no_list_and_every_url_of_a_list_is_masked() {
        assert_eq!(
            redact_url("amqp://u:pa,ss@h:5672/%2f"),
            "amqp://u:***@h:5672/%2f"
        );
        assert_eq!(redact_url_tokens("https://to,ken@h/x"), "https://***@h/x");
        assert_eq!(
            redact_url("nats://a:p1@h1:4222,nats://b:p2@h2:4222"),
            "nats://a:***@h1:4222,nats://b:***@h2:4222"
        );
    }

    #[test]
    fn masks_keyword_style() {
        assert_eq!(
            redact_url("host=db user=app password=hunter2 dbname=x"),
            "host=db user=app password=*** dbname=x"
        );
    }

    #[test]
    fn token_variant_masks_a_bare_userinfo_and_keeps_the_rest() {
        assert_eq!(
            redact_url_tokens("http://APIKEYSECRET@127.0.0.1:19201/hook"),
            "http://***@127.0.0.1:19201/hook"
        );
        assert_eq!(
            redact_url_tokens("https://user:s3cret@h.example.com/x?password=p"),
            "https://user:***@h.example.com/x?password=***"
        );
        assert_eq!(
            redact_url_tokens("https://h.example.com/a@b"),
            "https://h.example.com/a@b"
        );
        // The plain variant still shows a user name without a password.
        assert_eq!(
            redact_url("http://APIKEYSECRET@127.0.0.1/hook"),
            "http://APIKEYSECRET@127.0.0.1/hook"
        );
    }
}
