//! A consumer's verification of `outbox-signature` in Rust, with the RustCrypto `hmac` and
//! `sha2` crates (the relay signs with aws-lc-rs: a second, independent implementation). The
//! docs/wire-format.md shows the part between the markers.

use std::collections::HashMap;

// docs: begin rust
use base64::{Engine, engine::general_purpose::STANDARD};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

/// Whether `header` is a valid v1 signature under `keys` (key id → key). `attrs`, as received
/// (HTTP's `ce-*` headers percent-decoded first): id, source, type, subject ("" if none),
/// routing key or topic, time, datacontenttype.
pub fn verify(header: &str, keys: &HashMap<&str, &[u8]>, attrs: [&str; 7], body: &[u8]) -> bool {
    let mut parts = header.split(';');
    if parts.next() != Some("v1") {
        return false;
    }
    let (mut kid, mut sig) = (None, None);
    for part in parts {
        match part.split_once('=') {
            Some(("kid", v)) => kid = Some(v),
            Some(("sig", v)) => sig = Some(v),
            _ => {}
        }
    }
    let (Some(key), Some(Ok(sig))) = (
        kid.and_then(|k| keys.get(k)),
        sig.map(|s| STANDARD.decode(s)),
    ) else {
        return false; // unknown key id, or no signature
    };
    let body_hash = format!("{:x}", Sha256::digest(body));
    let mut lines = vec!["v1"];
    lines.extend(attrs);
    lines.push(&body_hash);
    let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(key) else {
        return false;
    };
    mac.update(lines.join("\n").as_bytes());
    mac.verify_slice(&sig).is_ok()
}
// docs: end rust
