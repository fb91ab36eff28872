//! Who may use the server, checked before any route runs (a middleware):
//!
//! - **`Host`** must name this server: an IP address or `localhost` by default, else a name
//!   in `--allowed-hosts` (`*`: any). A web page that rebinds its own DNS name to this
//!   address (DNS rebinding) sends that name, and is refused (421).
//! - **`Origin`**, when a browser sends one, must be the server's own (the `Host` it
//!   addressed, port included): another site's page cannot drive it (403; no CORS is
//!   served, so a browser's preflight is refused too).
//! - **POST bodies** must be `application/json` (415): a cross-site HTML form can send
//!   only `text/plain` and form types without a preflight (CSRF).
//! - **`Authorization: Bearer KEY`** on `/v1/…` when `--api-key` is given (401 with
//!   `WWW-Authenticate: Bearer`); the scheme's name in any case (RFC 7235 §2.1), the key
//!   compared in constant time.
use std::net::IpAddr;

use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// The access rules.
#[derive(Debug, Clone)]
pub struct Access {
    api_key: Option<String>,
    /// Names besides IP addresses and `localhost`; `None`: any.
    hosts: Option<Vec<String>>,
    /// Listening beyond loopback.
    exposed: bool,
}

impl Access {
    /// The rules for a server listening on `host`.
    pub fn new(host: IpAddr, api_key: Option<String>, allowed_hosts: Option<Vec<String>>) -> Self {
        let hosts = match allowed_hosts {
            Some(names) if names.iter().any(|n| n.trim() == "*") => None,
            Some(names) => Some(names.iter().map(|n| normal_host(n)).collect()),
            None => Some(Vec::new()),
        };
        Self {
            api_key,
            hosts,
            exposed: !host.is_loopback(),
        }
    }

    /// Whether anyone beyond this machine can reach a server that asks no key.
    pub fn exposed_without_key(&self) -> bool {
        self.exposed && self.api_key.is_none()
    }

    fn host_allowed(&self, host: &str) -> bool {
        let host = normal_host(host);
        match &self.hosts {
            None => true,
            Some(names) => {
                host == "localhost"
                    || host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok()
                    || names.contains(&host)
            }
        }
    }

    /// The request checked; the refusal otherwise.
    pub fn check(&self, method: &Method, path: &str, headers: &HeaderMap) -> Result<(), ApiError> {
        let text = |name| {
            headers
                .get(name)
                .and_then(|v: &HeaderValue| v.to_str().ok())
        };
        let Some(host) = text(header::HOST) else {
            return Err(ApiError::status(
                StatusCode::BAD_REQUEST,
                "a Host header is required",
            ));
        };
        if !self.host_allowed(split_port(host).0) {
            return Err(ApiError::status(
                StatusCode::MISDIRECTED_REQUEST,
                "this server does not answer to that Host name; the server's operator may add it with --allowed-hosts",
            ));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let same = origin
                .to_str()
                .ok()
                .and_then(|o| o.split_once("://"))
                .is_some_and(|(_, rest)| same_authority(rest, host));
            if !same {
                return Err(ApiError::status(
                    StatusCode::FORBIDDEN,
                    "requests from another origin (a web page of another site) are refused",
                ));
            }
        }
        if method == Method::POST && !is_json(text(header::CONTENT_TYPE)) {
            return Err(ApiError::status(
                StatusCode::UNSUPPORTED_MEDIA_TYPE,
                "send the body as JSON with `Content-Type: application/json`",
            ));
        }
        if let (Some(key), true) = (&self.api_key, path.starts_with("/v1/")) {
            let given = text(header::AUTHORIZATION).and_then(bearer);
            if !given.is_some_and(|g| bool::from(g.as_bytes().ct_eq(key.as_bytes()))) {
                let mut e = ApiError::status(
                    StatusCode::UNAUTHORIZED,
                    "missing or wrong API key: send `Authorization: Bearer KEY` with the server's --api-key",
                );
                e.authenticate = true;
                return Err(e);
            }
        }
        Ok(())
    }
}

/// The token of an `Authorization: Bearer TOKEN` value (the scheme in any case).
fn bearer(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim_start_matches(' '))
}

/// `application/json`, parameters (`; charset=utf-8`) and case aside.
fn is_json(content_type: Option<&str>) -> bool {
    content_type
        .and_then(|t| t.split(';').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case("application/json"))
}

/// A host name lower-cased, without a trailing dot.
fn normal_host(h: &str) -> String {
    h.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// `host[:port]` split (IPv6 literals in brackets).
fn split_port(authority: &str) -> (&str, Option<&str>) {
    if let Some(rest) = authority.strip_prefix('[') {
        if let Some(end) = rest.find(']') {
            let port = rest[end + 1..].strip_prefix(':');
            return (&authority[..end + 2], port);
        }
    }
    match authority.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') && p.bytes().all(|b| b.is_ascii_digit()) => (h, Some(p)),
        _ => (authority, None),
    }
}

/// Whether an `Origin`'s authority is the `Host` the request addressed.
fn same_authority(origin: &str, host: &str) -> bool {
    let (oh, op) = split_port(origin.trim_end_matches('/'));
    let (hh, hp) = split_port(host);
    normal_host(oh) == normal_host(hh) && op == hp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(*k, v);
            }
        }
        h
    }

    fn loopback(key: Option<&str>, hosts: Option<&[&str]>) -> Access {
        Access::new(
            IpAddr::from([127, 0, 0, 1]),
            key.map(str::to_string),
            hosts.map(|h| h.iter().map(|s| s.to_string()).collect()),
        )
    }

    fn status(a: &Access, m: Method, path: &str, h: &[(&'static str, &str)]) -> u16 {
        match a.check(&m, path, &headers(h)) {
            Ok(()) => 200,
            Err(e) => e.status.as_u16(),
        }
    }

    const JSON: (&str, &str) = ("content-type", "application/json");

    #[test]
    fn hosts_that_are_not_this_server_are_refused() {
        let a = loopback(None, None);
        for (host, want) in [
            ("127.0.0.1:8080", 200),
            ("localhost:8080", 200),
            ("LOCALHOST.", 200),
            ("[::1]:8080", 200),
            ("10.1.2.3", 200),
            ("evil.example:8080", 421),
            ("127.0.0.1.evil.example", 421),
        ] {
            assert_eq!(
                status(&a, Method::GET, "/v1/models", &[("host", host)]),
                want,
                "{host}"
            );
        }
        assert_eq!(status(&a, Method::GET, "/health", &[]), 400);
        let named = loopback(None, Some(&["api.example"]));
        assert_eq!(
            status(&named, Method::GET, "/health", &[("host", "API.example:1")]),
            200
        );
        let any = loopback(None, Some(&["*"]));
        assert_eq!(
            status(&any, Method::GET, "/health", &[("host", "x.example")]),
            200
        );
    }

    #[test]
    fn other_origins_and_form_bodies_are_refused() {
        let a = loopback(None, None);
        let host = ("host", "127.0.0.1:8080");
        let post = |h: &[(&'static str, &str)]| status(&a, Method::POST, "/v1/completions", h);
        assert_eq!(post(&[host, JSON]), 200);
        assert_eq!(
            post(&[host, ("content-type", "Application/JSON; charset=utf-8")]),
            200
        );
        assert_eq!(post(&[host, ("content-type", "text/plain")]), 415);
        assert_eq!(post(&[host]), 415);
        assert_eq!(
            post(&[host, JSON, ("origin", "http://127.0.0.1:8080")]),
            200
        );
        assert_eq!(post(&[host, JSON, ("origin", "http://evil.example")]), 403);
        assert_eq!(
            post(&[host, JSON, ("origin", "http://127.0.0.1:3000")]),
            403
        );
        assert_eq!(post(&[host, JSON, ("origin", "null")]), 403);
    }

    #[test]
    fn the_bearer_scheme_is_matched_in_any_case() {
        let a = loopback(Some("sk-1"), None);
        let host = ("host", "localhost");
        let get = |auth: &str| {
            status(
                &a,
                Method::GET,
                "/v1/models",
                &[host, ("authorization", auth)],
            )
        };
        assert_eq!(get("Bearer sk-1"), 200);
        assert_eq!(get("bearer sk-1"), 200);
        assert_eq!(get("BEARER  sk-1"), 200);
        assert_eq!(get("Bearer sk-2"), 401);
        assert_eq!(get("Bearer sk-10"), 401);
        assert_eq!(get("Bearer "), 401);
        assert_eq!(get("Basic sk-1"), 401);
        assert_eq!(status(&a, Method::GET, "/health", &[host]), 200);
    }

    #[test]
    fn only_a_wider_address_without_a_key_is_exposed() {
        assert!(!loopback(None, None).exposed_without_key());
        assert!(Access::new(IpAddr::from([0, 0, 0, 0]), None, None).exposed_without_key());
        assert!(
            !Access::new(IpAddr::from([0, 0, 0, 0]), Some("k".into()), None).exposed_without_key()
        );
    }
}
