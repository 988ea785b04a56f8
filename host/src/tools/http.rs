//! The `http` tool: `{method, url, headers?, body?}` for the destinations the
//! operator's `[[http]]` rules list, answered `{status, headers, body}`.
//!
//! A call no rule allows (scheme, host, port, method, path) is `denied`
//! before any connection. Names are resolved by the host and every address
//! checked: loopback, private, link-local (the cloud metadata address among
//! them), shared and unspecified ranges are refused unless the rule names
//! the address itself (an IP-literal URL) or lists the range in
//! `allow_ranges`. The check runs again inside the client's resolver, so a
//! name that changes its answer between the two is still refused. Redirects
//! are followed by the host, each hop checked as a new call. A guest may put
//! `{{secret:name}}` in a header value: the host substitutes the secret only
//! for a destination whose rule lists it.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use ipnet::IpNet;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Url};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::{describe, EventSink, Secrets, Tool, ToolCall};
use crate::error::HostError;

const TIMEOUT_MS_DEFAULT: u64 = 10_000;
const RESPONSE_BYTES_DEFAULT: u64 = 1 << 20;
/// Redirects one call follows.
pub const REDIRECTS_MAX: usize = 5;
/// Headers a guest may not set (the host's, or hop-by-hop).
const HOST_HEADERS: &[&str] = &["host", "content-length", "transfer-encoding", "connection", "upgrade", "te"];
/// Headers one call may send (its bytes are bounded by the manifest's `payload_bytes`).
const REQUEST_HEADERS_MAX: usize = 64;

/// One `[[http]]` rule of the tools file.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct HttpRule {
    /// `scheme://host[:port]`, nothing more: the destination.
    pub url: String,
    /// Methods allowed (default `["GET"]`).
    #[serde(default = "default_methods")]
    pub methods: Vec<String>,
    /// Path patterns allowed, `*` matching any run of characters (default
    /// `["/*"]`: every path).
    #[serde(default = "default_paths")]
    pub paths: Vec<String>,
    /// Names of `[secrets]` a call to this destination may use as `{{secret:name}}`.
    #[serde(default)]
    pub secrets: Vec<String>,
    /// Ranges (CIDR) the host's name may resolve to that are otherwise refused.
    #[serde(default)]
    pub allow_ranges: Vec<String>,
    /// One call, end to end, in milliseconds.
    #[serde(default = "timeout_default")]
    pub timeout_ms: u64,
    /// Bytes of one answer; a longer one fails the call.
    #[serde(default = "bytes_default")]
    pub max_response_bytes: u64,
    /// The tenants whose own plugins may call this destination (`["*"]`: every tenant);
    /// unset: as `--tenant-tools` says (none by default). Published plugins
    /// (the operator's) may use every tool.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// Attempts of one request, with backoff and jitter (default: one). A
    /// request that could not connect is tried again whatever its method;
    /// one with an idempotent method (GET, HEAD, OPTIONS, PUT, DELETE) also
    /// after a timeout, a broken connection or an answer of 408, 429 or 5xx
    /// (its `Retry-After` honoured). The last answer is the call's.
    #[serde(default)]
    pub retry: Option<super::models::RetryConfig>,
}

fn default_methods() -> Vec<String> {
    vec!["GET".into()]
}

fn default_paths() -> Vec<String> {
    vec!["/*".into()]
}

fn timeout_default() -> u64 {
    TIMEOUT_MS_DEFAULT
}

fn bytes_default() -> u64 {
    RESPONSE_BYTES_DEFAULT
}

/// A rule, checked and ready to match.
#[derive(Debug, Clone)]
struct Rule {
    origin: String,
    scheme: String,
    host: String,
    port: u16,
    /// The rule's host, when it is an address: that address is allowed.
    literal: Option<IpAddr>,
    methods: Vec<Method>,
    paths: Vec<String>,
    secrets: Vec<String>,
    allow: Vec<IpNet>,
    timeout: Duration,
    max_bytes: usize,
    /// The tenants whose plugins may call this destination.
    tenants: super::checks::TenantScope,
    retry: Option<super::models::RetryConfig>,
}

impl HttpRule {
    pub(crate) fn check(&self, secrets: &Secrets) -> Result<(), String> {
        self.compile(secrets, false).map(|_| ())
    }

    /// The rule ready to match; `tenants_default_all`: what a rule naming no
    /// `tenants` admits (`--tenant-tools`).
    fn compile(&self, secrets: &Secrets, tenants_default_all: bool) -> Result<Rule, String> {
        super::checks::check_http_url(&self.url)?;
        let url = Url::parse(&self.url).map_err(|e| e.to_string())?;
        if !(url.path() == "/" || url.path().is_empty()) || url.query().is_some() || !url.username().is_empty() {
            return Err("url names only scheme://host[:port]; paths go in `paths`".into());
        }
        let host = url.host_str().unwrap_or_default().trim_matches(['[', ']']).to_ascii_lowercase();
        let methods = self
            .methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes()).map_err(|_| format!("method {m:?} is not valid"))
            })
            .collect::<Result<Vec<_>, _>>()?;
        if methods.is_empty() || self.paths.is_empty() {
            return Err("methods and paths must not be empty".into());
        }
        if let Some(p) = self.paths.iter().find(|p| !p.starts_with('/')) {
            return Err(format!("path pattern {p:?} must start with /"));
        }
        if let Some(s) = self.secrets.iter().find(|s| !secrets.contains(s)) {
            return Err(format!("secret {s:?} is not in [secrets]"));
        }
        let allow = self
            .allow_ranges
            .iter()
            .map(|r| r.parse::<IpNet>().map_err(|_| format!("allow_ranges: {r:?} is not a CIDR range")))
            .collect::<Result<Vec<_>, _>>()?;
        super::checks::check_call_limits(self.timeout_ms, self.max_response_bytes)?;
        if let Some(r) = &self.retry {
            r.check().map_err(|e| format!("retry: {e}"))?;
        }
        Ok(Rule {
            origin: url.origin().ascii_serialization(),
            scheme: url.scheme().to_string(),
            literal: host.parse().ok(),
            port: url.port_or_known_default().unwrap_or(80),
            host,
            methods,
            paths: self.paths.clone(),
            secrets: self.secrets.clone(),
            allow,
            timeout: Duration::from_millis(self.timeout_ms),
            max_bytes: usize::try_from(self.max_response_bytes).unwrap_or(usize::MAX),
            tenants: super::checks::TenantScope::of(&self.tenants, tenants_default_all),
            retry: self.retry.clone(),
        })
    }
}

/// The path a rule's patterns are matched against: `raw` (as the URL
/// carries it, dot segments already removed) percent-decoded, so an encoded
/// `..%2F` is seen as the `../` the receiving server may take it for.
/// `None` when the decoded path still climbs (a `.` or `..` segment), holds
/// a backslash or a control character, or is not UTF-8: such a path is
/// refused whatever the patterns say.
fn decoded_path(raw: &str) -> Option<String> {
    let decoded = percent_encoding::percent_decode_str(raw).decode_utf8().ok()?.into_owned();
    // A segment's path parameters (`..;/`, as some servers read it) do not
    // hide a dot segment.
    let climbs =
        decoded.split('/').map(|seg| seg.split(';').next().unwrap_or_default()).any(|seg| seg == "." || seg == "..");
    // A `%` left after decoding is an encoding of an encoding: a server that
    // decodes twice would see what this check did not.
    let odd = decoded.chars().any(|c| c == '\\' || c == '%' || c.is_control());
    (!climbs && !odd).then_some(decoded)
}

/// Whether `path` matches `pattern`, where `*` matches any run of characters.
fn path_matches(pattern: &str, path: &str) -> bool {
    let mut parts = pattern.split('*');
    let first = parts.next().unwrap_or_default();
    let Some(mut rest) = path.strip_prefix(first) else { return false };
    let parts: Vec<&str> = parts.collect();
    let Some((last, middle)) = parts.split_last() else { return rest.is_empty() };
    for part in middle {
        match rest.find(part) {
            Some(at) => rest = &rest[at + part.len()..],
            None => return false,
        }
    }
    rest.ends_with(last)
}

/// The IPv4 address an IPv6 one carries to an IPv4 host, if any:
/// IPv4-mapped `::ffff:a.b.c.d`, IPv4-compatible `::a.b.c.d`, NAT64
/// (`64:ff9b::/96`, `64:ff9b:1::/48`) and 6to4 (`2002::/16`). Such an
/// address is checked as the IPv4 one it reaches.
fn embedded_v4(v6: Ipv6Addr) -> Option<Ipv4Addr> {
    let seg = v6.segments();
    let o = v6.octets();
    let last = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if let Some(v4) = v6.to_ipv4_mapped() {
        Some(v4)
    } else if seg[..6] == [0; 6] && !v6.is_loopback() && !v6.is_unspecified() {
        Some(last)
    } else if seg[..6] == [0x64, 0xff9b, 0, 0, 0, 0] || (seg[0] == 0x64 && seg[1] == 0xff9b && seg[2] == 1) {
        Some(last)
    } else if seg[0] == 0x2002 {
        Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]))
    } else {
        None
    }
}

/// Why an address is refused, if it is in a blocked range.
fn blocked(ip: IpAddr) -> Option<&'static str> {
    let ip = match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    };
    match ip {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            if v4.is_loopback() {
                Some("a loopback address")
            } else if v4.is_private() {
                Some("a private address")
            } else if v4.is_link_local() {
                Some("a link-local address (the cloud metadata range)")
            } else if o[0] == 100 && (64..128).contains(&o[1]) {
                Some("a shared (carrier-grade NAT) address")
            } else if o[0] == 192 && o[1] == 0 && o[2] == 0 {
                Some("an IETF protocol assignment address (192.0.0.0/24)")
            } else if o[0] == 198 && (o[1] & 0xfe) == 18 {
                Some("a benchmarking address (198.18.0.0/15)")
            } else if o[0] == 0 || o[0] >= 240 || v4.is_multicast() {
                Some("an unroutable address")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            let seg = v6.segments();
            if v6.is_loopback() {
                Some("a loopback address")
            } else if (seg[0] & 0xfe00) == 0xfc00 {
                Some("a private (unique local) address")
            } else if (seg[0] & 0xffc0) == 0xfe80 {
                Some("a link-local address")
            } else if (seg[0] & 0xffc0) == 0xfec0 {
                Some("a site-local address (fec0::/10)")
            } else if v6.is_unspecified() || v6.is_multicast() {
                Some("an unroutable address")
            } else {
                None
            }
        }
    }
}

/// The rules, shared by the tool and its client's resolver.
#[derive(Debug)]
struct Rules(Vec<Rule>);

impl Rules {
    /// The rule allowing `method` on `url` for a plugin of `tenant` (`None`:
    /// a published plugin, which every rule admits).
    fn find(&self, method: &Method, url: &Url, tenant: Option<&str>) -> Option<&Rule> {
        let host = url.host_str()?.trim_matches(['[', ']']).to_ascii_lowercase();
        let port = url.port_or_known_default()?;
        let path = decoded_path(url.path())?;
        self.0.iter().find(|r| {
            r.scheme == url.scheme()
                && r.host == host
                && r.port == port
                && r.methods.contains(method)
                && r.paths.iter().any(|p| path_matches(p, &path))
                && tenant.is_none_or(|t| r.tenants.admits(t))
        })
    }

    /// Whether a name's resolved address may be connected to: not in a
    /// blocked range, or in a range a rule for that name allows.
    fn address_ok(&self, host: &str, ip: IpAddr) -> Result<(), String> {
        let Some(why) = blocked(ip) else { return Ok(()) };
        let allowed = self.0.iter().filter(|r| r.host == host).any(|r| r.allow.iter().any(|n| n.contains(&ip)));
        match allowed {
            true => Ok(()),
            false => Err(format!("{host} resolves to {ip}, {why}, which no rule names")),
        }
    }

    /// Resolves `host` and checks every address.
    async fn resolve(&self, host: &str) -> Result<Vec<SocketAddr>, String> {
        let addrs: Vec<SocketAddr> =
            tokio::net::lookup_host((host, 0)).await.map_err(|e| format!("{host} does not resolve: {e}"))?.collect();
        if addrs.is_empty() {
            return Err(format!("{host} does not resolve"));
        }
        for a in &addrs {
            self.address_ok(host, a.ip())?;
        }
        Ok(addrs)
    }
}

/// The client's resolver: the same checks at connection time.
struct Guard(Arc<Rules>);

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct Refused(String);

impl reqwest::dns::Resolve for Guard {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let rules = self.0.clone();
        Box::pin(async move {
            let host = name.as_str().to_ascii_lowercase();
            let addrs = rules.resolve(&host).await.map_err(Refused)?;
            Ok(Box::new(addrs.into_iter()) as reqwest::dns::Addrs)
        })
    }
}

pub(crate) struct Http {
    rules: Arc<Rules>,
    client: reqwest::Client,
    secrets: Secrets,
    timeout: Duration,
}

/// What a guest asks for.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Args {
    method: String,
    url: String,
    #[serde(default)]
    headers: Map<String, Value>,
    #[serde(default)]
    body: Option<String>,
}

fn denied(m: String) -> HostError {
    HostError::Denied(format!("http: {m}"))
}

impl Http {
    pub fn new(rules: &[HttpRule], secrets: &Secrets, tenants_default_all: bool) -> Result<Http, String> {
        let rules = rules.iter().map(|r| r.compile(secrets, tenants_default_all)).collect::<Result<Vec<_>, _>>()?;
        let timeout = rules.iter().map(|r| r.timeout).max().unwrap_or(Duration::from_millis(TIMEOUT_MS_DEFAULT));
        let rules = Arc::new(Rules(rules));
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .dns_resolver(Arc::new(Guard(rules.clone())))
            .build()
            .map_err(|e| format!("cannot build the http tool's client: {e}"))?;
        Ok(Http { rules, client, secrets: secrets.clone(), timeout })
    }

    /// The rule that allows `method` on `url` for `tenant`'s plugin, after
    /// the address checks.
    async fn allow(&self, method: &Method, url: &Url, tenant: Option<&str>) -> Result<&Rule, HostError> {
        let rule = self.rules.find(method, url, tenant).ok_or_else(|| {
            let host = url.host_str().unwrap_or_default();
            let port = url.port_or_known_default().unwrap_or_default();
            denied(format!("no rule allows {method} {}://{host}:{port}{}", url.scheme(), url.path()))
        })?;
        if rule.literal.is_none() {
            self.rules.resolve(&rule.host).await.map_err(denied)?;
        }
        Ok(rule)
    }

    /// The guest's headers for `rule`'s destination, with each
    /// `{{secret:name}}` substituted (only secrets the rule lists).
    fn headers(&self, asked: &Map<String, Value>, rule: &Rule) -> Result<HeaderMap, HostError> {
        if asked.len() > REQUEST_HEADERS_MAX {
            return Err(HostError::Invalid(format!("http: at most {REQUEST_HEADERS_MAX} headers")));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in asked {
            let value =
                value.as_str().ok_or_else(|| HostError::Invalid(format!("http: header {name:?} is not a string")))?;
            let header = HeaderName::from_bytes(name.as_bytes())
                .map_err(|_| HostError::Invalid(format!("http: header {name:?} is not valid")))?;
            if HOST_HEADERS.contains(&header.as_str()) {
                return Err(HostError::Invalid(format!("http: header {name:?} is set by the host")));
            }
            let mut out = String::new();
            let mut rest = value;
            let mut secret = false;
            while let Some(at) = rest.find("{{secret:") {
                out.push_str(&rest[..at]);
                let after = &rest[at + 9..];
                let end = after
                    .find("}}")
                    .ok_or_else(|| HostError::Invalid("http: an unterminated {{secret:...}}".into()))?;
                let key = &after[..end];
                if !rule.secrets.iter().any(|s| s == key) {
                    return Err(denied(format!("secret {key:?} is not bound to {}", rule.origin)));
                }
                out.push_str(self.secrets.get(key).unwrap_or_default());
                secret = true;
                rest = &after[end + 2..];
            }
            out.push_str(rest);
            let mut v = HeaderValue::from_str(&out)
                .map_err(|_| HostError::Invalid(format!("http: header {name:?} has an invalid value")))?;
            v.set_sensitive(secret);
            headers.append(header, v);
        }
        Ok(headers)
    }

    async fn fetch(&self, args: Args, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let tenant = call.tenant;
        let mut method = Method::from_bytes(args.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| HostError::Invalid(format!("http: method {:?} is not valid", args.method)))?;
        let mut url = Url::parse(&args.url).map_err(|e| HostError::Invalid(format!("http: url: {e}")))?;
        if !url.username().is_empty() || url.password().is_some() {
            return Err(HostError::Invalid("http: credentials go in headers, not the url".into()));
        }
        let mut body = args.body;
        for hop in 0..=REDIRECTS_MAX {
            let rule = self.allow(&method, &url, tenant).await?.clone();
            let headers = self.headers(&args.headers, &rule)?;
            let idempotent =
                matches!(method, Method::GET | Method::HEAD | Method::OPTIONS | Method::PUT | Method::DELETE);
            let mut attempt = 0;
            let sent = loop {
                attempt += 1;
                let failed = match self.send(&rule, &method, &url, &headers, body.as_ref(), idempotent).await {
                    Ok(sent) => break sent,
                    Err(failed) => failed,
                };
                // The last attempt's answer is the call's, whatever its status.
                let last = !(failed.failed.retryable && rule.retry.as_ref().is_some_and(|r| attempt < r.attempts));
                if let (true, Some(answer)) = (last, failed.answer) {
                    break answer;
                }
                super::models::RetryConfig::again(rule.retry.as_ref(), attempt, call, sink, failed.failed).await?;
            };
            match sent {
                Ok((status, headers, bytes, cut)) => {
                    let mut h = Map::new();
                    for (k, v) in &headers {
                        let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
                        match h.get_mut(k.as_str()) {
                            Some(Value::String(s)) => {
                                s.push_str(", ");
                                s.push_str(&v);
                            }
                            _ => {
                                h.insert(k.as_str().to_string(), Value::String(v));
                            }
                        }
                    }
                    let mut answer =
                        json!({ "status": status.as_u16(), "headers": h, "body": String::from_utf8_lossy(&bytes) });
                    if cut {
                        answer["truncated"] =
                            json!(format!("max_response_bytes: the body was cut at {} bytes", rule.max_bytes));
                    }
                    return Ok(answer);
                }
                Err((status, location)) => {
                    let location = location.and_then(|l| l.to_str().ok().map(str::to_string)).ok_or_else(|| {
                        HostError::ToolFailed(format!("http: {} answered {status} without a Location", rule.origin))
                    })?;
                    if hop == REDIRECTS_MAX {
                        return Err(HostError::ToolFailed(format!("http: more than {REDIRECTS_MAX} redirects")));
                    }
                    url = url.join(&location).map_err(|e| HostError::ToolFailed(format!("http: bad redirect: {e}")))?;
                    // 303 (and 301/302 after a POST) turn into a GET without a body.
                    if status == reqwest::StatusCode::SEE_OTHER
                        || (method == Method::POST && matches!(status.as_u16(), 301 | 302))
                    {
                        method = Method::GET;
                        body = None;
                    }
                }
            }
        }
        unreachable!("the loop returns")
    }
}

/// One hop's answer: its status, headers, body and whether the body was
/// cut; or a redirect's status and `Location`.
type Sent = Result<
    (reqwest::StatusCode, reqwest::header::HeaderMap, Vec<u8>, bool),
    (reqwest::StatusCode, Option<reqwest::header::HeaderValue>),
>;

/// A failed attempt of one hop, with the answer it got if any (the call's
/// answer when no attempt follows).
struct HopFailed {
    failed: super::models::Failed,
    answer: Option<Sent>,
}

impl Http {
    /// One attempt of one hop: its answer, or a failure that says whether
    /// another attempt may be made (see [`HttpRule::retry`]).
    async fn send(
        &self,
        rule: &Rule,
        method: &Method,
        url: &Url,
        headers: &reqwest::header::HeaderMap,
        body: Option<&String>,
        idempotent: bool,
    ) -> Result<Sent, HopFailed> {
        let fail = |error: HostError, status: Option<u16>, retryable: bool| HopFailed {
            failed: super::models::Failed { error, status, after: None, retryable },
            answer: None,
        };
        let mut request = self.client.request(method.clone(), url.clone()).headers(headers.clone());
        if let Some(b) = body {
            request = request.body(b.clone());
        }
        let send = async {
            let resp = request.send().await?;
            let status = resp.status();
            if matches!(status.as_u16(), 301 | 302 | 303 | 307 | 308) {
                return Ok(Err((status, resp.headers().get("location").cloned())));
            }
            let headers = resp.headers().clone();
            let (bytes, cut) = read_up_to(resp, rule.max_bytes).await?;
            Ok(Ok((status, headers, bytes, cut)))
        };
        let sent: Result<Sent, reqwest::Error> = match tokio::time::timeout(rule.timeout, send).await {
            Ok(sent) => sent,
            Err(_) => {
                let why =
                    format!("http: {} did not answer within {} ms (timeout_ms)", rule.origin, rule.timeout.as_millis());
                return Err(fail(HostError::ToolFailed(why), None, idempotent));
            }
        };
        let sent = sent.map_err(|e| {
            let refused = std::iter::successors(std::error::Error::source(&e), |s| s.source())
                .find_map(|s| s.downcast_ref::<Refused>());
            match refused {
                Some(r) => fail(denied(r.0.clone()), None, false),
                None => {
                    // Never connected: the destination never saw it.
                    let retryable = e.is_connect() || idempotent;
                    let why = format!("http: {} could not be called: {}", rule.origin, describe(e));
                    fail(HostError::ToolFailed(why), None, retryable)
                }
            }
        })?;
        if let Ok((status, headers, _, _)) = &sent {
            if idempotent && (matches!(status.as_u16(), 408 | 429) || status.is_server_error()) {
                let after = headers
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.trim().parse::<u64>().ok())
                    .map(|s| Duration::from_secs(s.min(600)));
                let error = HostError::ToolFailed(format!("http: {} answered {status}", rule.origin));
                let failed = super::models::Failed { error, status: Some(status.as_u16()), after, retryable: true };
                return Err(HopFailed { failed, answer: Some(sent) });
            }
        }
        Ok(sent)
    }
}

/// The body, up to `cap` bytes, and whether it was cut there.
async fn read_up_to(mut resp: reqwest::Response, cap: usize) -> Result<(Vec<u8>, bool), reqwest::Error> {
    let mut body = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        let room = cap - body.len();
        if chunk.len() > room {
            body.extend_from_slice(&chunk[..room]);
            return Ok((body, true));
        }
        body.extend_from_slice(&chunk);
    }
    Ok((body, false))
}

#[async_trait]
impl Tool for Http {
    async fn call(&self, call: &ToolCall<'_>, sink: &dyn EventSink) -> Result<Value, HostError> {
        let args: Args = serde_json::from_value(call.args.clone())
            .map_err(|e| HostError::Invalid(format!("http takes {{method, url, headers?, body?}}: {e}")))?;
        self.fetch(args, call, sink).await
    }

    fn timeout(&self) -> Duration {
        // Each hop has its rule's timeout; the whole call, redirects
        // included, at most this.
        self.timeout * (REDIRECTS_MAX as u32 + 1)
    }

    fn describe(&self) -> (Option<String>, Value) {
        let destinations: Vec<&str> = self.rules.0.iter().map(|r| r.origin.as_str()).collect();
        let description = format!(
            "An HTTP request to an allowed destination ({}); answers {{status, headers, body}}",
            destinations.join(", ")
        );
        let schema = json!({
            "type": "object",
            "properties": {
                "method": { "type": "string" },
                "url": { "type": "string" },
                "headers": { "type": "object", "additionalProperties": { "type": "string" } },
                "body": { "type": "string" },
            },
            "required": ["method", "url"],
        });
        (Some(description), schema)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn path_patterns_match() {
        assert!(path_matches("/*", "/"));
        assert!(path_matches("/v1/*", "/v1/weather"));
        assert!(!path_matches("/v1/*", "/v2/weather"));
        assert!(path_matches("/v1/*/now", "/v1/lyon/now"));
        assert!(!path_matches("/v1/*/now", "/v1/lyon/later"));
        assert!(path_matches("/exact", "/exact"));
        assert!(!path_matches("/exact", "/exact/more"));
    }

    #[test]
    fn blocked_ranges() {
        for ip in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.100.100.200",
            "0.0.0.0",
            "::1",
            "fd00:ec2::254",
            "fe80::1",
            "::ffff:127.0.0.1",
            "192.0.0.170",
            "198.18.0.1",
            "198.19.255.254",
            "240.0.0.1",
            "255.255.255.255",
            "64:ff9b::a9fe:a9fe",
            "64:ff9b::127.0.0.1",
            "64:ff9b:1::10.0.0.1",
            "2002:c0a8:0101::1",
            "2002:7f00:1::",
            "::10.0.0.1",
            "::169.254.169.254",
            "fec0::1",
        ] {
            assert!(blocked(ip.parse().unwrap()).is_some(), "{ip}");
        }
        for ip in ["93.184.216.34", "2606:4700::1111", "8.8.8.8", "64:ff9b::8.8.8.8", "2002:0808:0808::1", "198.20.0.1"]
        {
            assert!(blocked(ip.parse().unwrap()).is_none(), "{ip}");
        }
    }

    /// A rule to `url` at the defaults (GET, every path, no secrets).
    fn rule(url: &str) -> HttpRule {
        HttpRule {
            url: url.into(),
            methods: default_methods(),
            paths: default_paths(),
            secrets: vec![],
            allow_ranges: vec![],
            timeout_ms: 1,
            max_response_bytes: 1,
            tenants: None,
            retry: None,
        }
    }

    /// Issue 40: path rules are matched on the decoded, normalised path: an
    /// encoded `..%2F` cannot climb out of `/v1/*` on the receiving server.
    #[test]
    fn path_rules_see_the_decoded_path() {
        let rule = HttpRule { paths: vec!["/v1/*".into()], ..rule("https://api.example") };
        let rules = Rules(vec![rule.compile(&Secrets::default(), false).unwrap()]);
        let allowed = |u: &str| rules.find(&Method::GET, &Url::parse(u).unwrap(), None).is_some();
        assert!(allowed("https://api.example/v1/items"));
        assert!(allowed("https://api.example/v1/caf%C3%A9"), "an encoded letter is that letter");
        assert!(!allowed("https://api.example/v1/../admin"), "the URL parser removes plain dot segments");
        for climbing in [
            "https://api.example/v1/..%2Fadmin",
            "https://api.example/v1/%2E%2E/admin",
            "https://api.example/v1/%2e%2e%2fadmin",
            "https://api.example/v1/x%5C..%5Cadmin",
            "https://api.example/v1/%00",
            "https://api.example/v1/..;/admin",
            "https://api.example/v1/%252e%252e%252fadmin",
        ] {
            assert!(!allowed(climbing), "{climbing}");
        }
        assert!(!allowed("https://api.example/v2%2F..%2Fv1/items"), "decoded, it is not under /v1/");
    }

    #[test]
    fn a_rule_url_has_no_path() {
        let r = rule("https://a.example/v1");
        assert!(r.check(&Secrets::default()).unwrap_err().contains("only scheme://host[:port]"));
    }

    /// Issue 40: a rule naming `tenants` admits those tenants' plugins only
    /// (published plugins, `None`, use every rule), whatever `--tenant-tools` says.
    #[test]
    fn a_rule_for_one_tenant_is_not_found_for_another() {
        let rule = HttpRule { tenants: Some(vec!["acme".into()]), ..rule("https://api.example") };
        let url = Url::parse("https://api.example/v1/items").unwrap();
        for tenants_default_all in [false, true] {
            let rules = Rules(vec![rule.compile(&Secrets::default(), tenants_default_all).unwrap()]);
            assert!(rules.find(&Method::GET, &url, Some("acme")).is_some(), "default_all={tenants_default_all}");
            assert!(rules.find(&Method::GET, &url, Some("evil")).is_none(), "default_all={tenants_default_all}");
            assert!(rules.find(&Method::GET, &url, Some("")).is_none());
            assert!(rules.find(&Method::GET, &url, None).is_some(), "a published plugin");
        }
    }
}
