//! What every operator-defined tool (webhook, `http` rule, MCP server)
//! shares, below the tools file's parser and the tools themselves: the
//! bounds of a call's timeout and answer, the URL check, and the secrets the
//! file took from the environment.

use std::collections::BTreeMap;
use std::fmt;

use serde_json::Value;

/// The longest timeout any operator-defined tool (webhook, `http` rule, MCP
/// server) may have.
pub(crate) const TIMEOUT_MS_MAX: u64 = 600_000;
/// The largest answer cap any operator-defined tool may have.
pub(crate) const RESPONSE_BYTES_MAX: u64 = 16 << 20;

/// The check every operator-defined tool's timeout and answer cap pass.
pub(crate) fn check_call_limits(timeout_ms: u64, max_response_bytes: u64) -> Result<(), String> {
    if !(1..=TIMEOUT_MS_MAX).contains(&timeout_ms) {
        return Err(format!("timeout_ms must be 1 to {TIMEOUT_MS_MAX}, not {timeout_ms}"));
    }
    if !(1..=RESPONSE_BYTES_MAX).contains(&max_response_bytes) {
        return Err(format!("max_response_bytes must be 1 to {RESPONSE_BYTES_MAX}, not {max_response_bytes}"));
    }
    Ok(())
}
/// http or https, with a host: anything else would fail on every call
/// instead of at start.
pub(crate) fn check_http_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?} is not a URL ({e})"))?;
    match parsed.scheme() {
        "http" | "https" if parsed.host().is_some() => Ok(()),
        "http" | "https" => Err(format!("{url:?} has no host")),
        other => Err(format!("{url:?} has scheme {other:?}; only http:// and https:// are supported")),
    }
}

/// The values the tools file took from the environment, and its named
/// secrets. Never printed: `Debug` shows names only. [`Secrets::redact`]
/// cuts every value out of a text a guest, the journal or a log would see.
#[derive(Clone, Default)]
pub struct Secrets {
    named: BTreeMap<String, String>,
    /// The `[secrets]` values and the values header values took from the
    /// environment: what redaction looks for (URL pieces such as hosts and
    /// ports are not secrets and are left alone).
    values: Vec<String>,
    /// Every form of every value ([`forms`]), longest first.
    forms: Vec<String>,
}

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Secrets").field("named", &self.named.keys().collect::<Vec<_>>()).finish()
    }
}

/// The tenants whose own plugins may use an operator's tool (a webhook, an
/// MCP server, an `http` rule): a tool entry's `tenants`, or the host's
/// `--tenant-tools` default where it names none. Published plugins (the
/// operator's own) are not held to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TenantScope {
    All,
    Only(Vec<String>),
}

impl TenantScope {
    /// The scope an entry's `tenants` gives (`["*"]`: every tenant), or the
    /// default when it gives none.
    pub fn of(tenants: &Option<Vec<String>>, default_all: bool) -> Self {
        match tenants {
            Some(list) if list.iter().any(|t| t == "*") => TenantScope::All,
            Some(list) => TenantScope::Only(list.clone()),
            None if default_all => TenantScope::All,
            None => TenantScope::Only(Vec::new()),
        }
    }

    pub fn admits(&self, tenant: &str) -> bool {
        match self {
            TenantScope::All => true,
            TenantScope::Only(list) => list.iter().any(|t| t == tenant),
        }
    }
}

/// The forms a secret may take in a text: as is, escaped inside a JSON
/// string (once, and twice: JSON carried inside a JSON string),
/// percent-encoded (in a URL or a form) and in base64 (standard and URL
/// alphabets, as a Basic credential or a token carries it).
fn forms(v: &str) -> Vec<String> {
    let once = serde_json::to_string(v).unwrap_or_default();
    let once = once.trim_matches('"').to_string();
    let twice = serde_json::to_string(&once).unwrap_or_default().trim_matches('"').to_string();
    // Every character but letters and digits, and what URL encoders leave
    // alone in a component (`-._~`).
    const COMPONENT: &percent_encoding::AsciiSet =
        &percent_encoding::NON_ALPHANUMERIC.remove(b'-').remove(b'.').remove(b'_').remove(b'~');
    let percent = percent_encoding::utf8_percent_encode(v, percent_encoding::NON_ALPHANUMERIC).to_string();
    let component = percent_encoding::utf8_percent_encode(v, COMPONENT).to_string();
    let mut all = vec![v.to_string(), once, twice, percent, component];
    // In base64 the secret's characters depend on where it starts among the
    // text's bytes (`user:secret` in a Basic credential): encoded after 0, 1
    // and 2 bytes of filler, the part that never depends on the filler or on
    // what follows is what any such encoding of it holds.
    for engine in [&base64::engine::general_purpose::STANDARD_NO_PAD, &base64::engine::general_purpose::URL_SAFE_NO_PAD]
    {
        for lead in 0..3usize {
            let mut bytes = vec![0u8; lead];
            bytes.extend_from_slice(v.as_bytes());
            let encoded = base64::Engine::encode(engine, &bytes);
            // Characters fixed by the filler (ceil(lead * 4 / 3)) and the
            // last, incomplete group, which depends on what follows.
            let skip = (lead * 4).div_ceil(3);
            let whole = (bytes.len() / 3) * 4;
            if whole > skip + 4 {
                all.push(encoded[skip..whole].to_string());
            }
        }
    }
    all.dedup();
    all.retain(|f| f.len() >= 4);
    all
}

/// A secret shorter than this is refused at start: redacting it would cut
/// ordinary words and numbers out of answers.
pub(crate) const SECRET_BYTES_MIN: usize = 8;

impl Secrets {
    /// The value of the named secret.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.named.get(name).map(String::as_str)
    }

    pub fn contains(&self, name: &str) -> bool {
        self.named.contains_key(name)
    }

    /// `text` (an error or a log line, not JSON) with every secret value (in
    /// each of its [`forms`]) replaced by `<redacted>`.
    pub fn redact(&self, text: &str) -> String {
        let mut out = text.to_string();
        for form in &self.forms {
            if out.contains(form.as_str()) {
                out = out.replace(form.as_str(), "<redacted>");
            }
        }
        out
    }

    /// A JSON answer with every secret value cut out of its strings and
    /// keys; numbers, booleans and the structure are left as they are, so
    /// the answer stays valid JSON.
    pub fn redact_value(&self, value: Value) -> Value {
        if self.values.is_empty() {
            return value;
        }
        let cut = |s: String| self.redact(&s);
        match value {
            Value::String(s) => Value::String(cut(s)),
            Value::Array(items) => Value::Array(items.into_iter().map(|v| self.redact_value(v)).collect()),
            Value::Object(map) => Value::Object(map.into_iter().map(|(k, v)| (cut(k), self.redact_value(v))).collect()),
            other => other,
        }
    }

    /// Whether nothing needs redacting.
    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Adds a value to redact (a test's, or one from the environment).
    pub fn add_value(&mut self, value: &str) {
        if !self.values.iter().any(|v| v == value) {
            self.values.push(value.to_string());
            self.forms.extend(forms(value));
            self.forms.sort_by_key(|f| std::cmp::Reverse(f.len()));
            self.forms.dedup();
        }
    }

    /// A named secret (tests; the tools file uses `[secrets]`).
    pub fn insert(&mut self, name: &str, value: &str) {
        self.named.insert(name.to_string(), value.to_string());
        self.add_value(value);
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// Issue 40: a secret is cut in every form a text may carry it in.
    #[test]
    fn a_secret_is_redacted_in_each_of_its_forms() {
        use base64::Engine;
        let mut s = Secrets::default();
        let secret = "sk-live/abc\"def+ghi";
        s.add_value(secret);
        let once = serde_json::to_string(secret).unwrap();
        let twice = serde_json::to_string(&once).unwrap();
        let percent = percent_encoding::utf8_percent_encode(secret, percent_encoding::NON_ALPHANUMERIC).to_string();
        let b64 = base64::engine::general_purpose::STANDARD_NO_PAD.encode(secret);
        let basic = base64::engine::general_purpose::STANDARD.encode(format!("user:{secret}"));
        let basic2 = base64::engine::general_purpose::STANDARD.encode(format!("us:{secret}:x"));
        for text in [secret.to_string(), once, twice, percent, b64, basic, basic2] {
            let said = format!("before {text} after");
            let cut = s.redact(&said);
            assert!(cut.contains("<redacted>") && !cut.contains("ghi"), "{said} -> {cut}");
        }
        let answer = json!({ "nested": [format!("key={secret}")], format!("{secret}"): 1 });
        assert!(!s.redact_value(answer).to_string().contains("ghi"));
    }
}
