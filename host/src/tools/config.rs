//! What the operator configures: the model endpoint and the webhook tools
//! file. Everything is checked when the host starts, so a typo is a refusal
//! to start rather than every run failing later.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;

use super::{LLM_TOOL, WAIT_TOOL};

/// The model behind the `llm` tool.
#[derive(Clone)]
pub struct LlmConfig {
    /// An OpenAI-compatible endpoint (`http://host:port/v1`); without one the
    /// offline provider answers.
    pub base_url: Option<String>,
    /// Sent as `Authorization: Bearer`; never shown to guests.
    pub api_key: Option<String>,
    pub model: String,
    /// One whole model call, retries included.
    pub timeout: Duration,
    /// Silence allowed between two pieces of the streamed answer.
    pub idle_timeout: Duration,
}

/// Hand-written so that logging a config never prints the key.
impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmConfig")
            .field("base_url", &self.base_url)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("model", &self.model)
            .field("timeout", &self.timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// The offline provider, with the timeouts the flags default to.
impl Default for LlmConfig {
    fn default() -> Self {
        LlmConfig {
            base_url: None,
            api_key: None,
            model: "gpt-4o-mini".into(),
            timeout: Duration::from_secs(120),
            idle_timeout: Duration::from_secs(30),
        }
    }
}

impl LlmConfig {
    pub(crate) fn check(&self) -> Result<(), String> {
        if let Some(url) = &self.base_url {
            check_http_url(url).map_err(|e| format!("llm base URL: {e}"))?;
        }
        if self.model.trim().is_empty() {
            return Err("llm model must not be empty".into());
        }
        if self.timeout.is_zero() || self.idle_timeout.is_zero() {
            return Err("llm timeouts must be greater than zero".into());
        }
        Ok(())
    }
}

const WEBHOOK_TIMEOUT_MS_DEFAULT: u64 = 10_000;
const WEBHOOK_TIMEOUT_MS_MAX: u64 = 600_000;
const WEBHOOK_RESPONSE_BYTES_DEFAULT: u64 = 1 << 20;
const WEBHOOK_RESPONSE_BYTES_MAX: u64 = 16 << 20;
/// Headers the host sets itself on every webhook call.
const HOST_HEADERS: &[&str] = &["content-type", "content-length", "host", "idempotency-key", "transfer-encoding"];

/// One operator-defined webhook tool (a `[[webhook]]` table of the tools file).
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// The name guests call it by (and manifests grant).
    pub name: String,
    /// The only URL this tool ever calls.
    pub url: String,
    #[serde(default = "webhook_timeout_ms_default")]
    pub timeout_ms: u64,
    #[serde(default = "webhook_response_bytes_default")]
    pub max_response_bytes: u64,
    /// Sent with every call (credentials such as `Authorization`); never
    /// shown to guests.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    #[serde(default)]
    pub description: Option<String>,
    /// The receiver honours the `Idempotency-Key`: a resumed run whose call
    /// to this tool was in flight at a crash sends it again with the same
    /// key. Otherwise (the default) such a run ends failed rather than call
    /// it twice.
    #[serde(default)]
    pub idempotent: bool,
    /// `"always"`: every call waits for a person's approval, whatever the
    /// plugin's manifest says (`"never"`, the default: as the manifest says).
    #[serde(default)]
    pub approval: Option<crate::run::manifest::Approval>,
}

fn webhook_timeout_ms_default() -> u64 {
    WEBHOOK_TIMEOUT_MS_DEFAULT
}

fn webhook_response_bytes_default() -> u64 {
    WEBHOOK_RESPONSE_BYTES_DEFAULT
}

/// Hand-written so that logging a config never prints header values.
impl fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WebhookConfig")
            .field("name", &self.name)
            .field("url", &self.url)
            .field("timeout_ms", &self.timeout_ms)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("headers", &self.headers.keys().collect::<Vec<_>>())
            .field("description", &self.description)
            .field("idempotent", &self.idempotent)
            .field("approval", &self.approval)
            .finish()
    }
}

impl WebhookConfig {
    /// Checks the entry and returns its headers ready to send.
    pub(crate) fn check(&self) -> Result<HeaderMap, String> {
        let name_ok = (1..=64).contains(&self.name.len())
            && self.name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !name_ok {
            return Err(format!("name {:?} must be 1-64 characters of a-z, 0-9, _ and -", self.name));
        }
        if self.name == LLM_TOOL {
            return Err(format!("name {LLM_TOOL:?} is the host's model tool"));
        }
        if self.name == WAIT_TOOL {
            return Err(format!("name {WAIT_TOOL:?} is the host's durable wait"));
        }
        check_http_url(&self.url).map_err(|e| format!("url: {e}"))?;
        if !(1..=WEBHOOK_TIMEOUT_MS_MAX).contains(&self.timeout_ms) {
            return Err(format!("timeout_ms must be 1 to {WEBHOOK_TIMEOUT_MS_MAX}, not {}", self.timeout_ms));
        }
        if !(1..=WEBHOOK_RESPONSE_BYTES_MAX).contains(&self.max_response_bytes) {
            return Err(format!(
                "max_response_bytes must be 1 to {WEBHOOK_RESPONSE_BYTES_MAX}, not {}",
                self.max_response_bytes
            ));
        }
        let mut headers = HeaderMap::new();
        for (name, value) in &self.headers {
            let name =
                HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("header {name:?} is not a valid name"))?;
            if HOST_HEADERS.contains(&name.as_str()) {
                return Err(format!("header {name:?} is set by the host"));
            }
            let mut value =
                HeaderValue::from_str(value).map_err(|_| format!("header {name:?} has an invalid value"))?;
            value.set_sensitive(true);
            headers.insert(name, value);
        }
        Ok(headers)
    }
}

/// http or https, with a host: anything else would fail on every call
/// instead of at start.
fn check_http_url(url: &str) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("{url:?} is not a URL ({e})"))?;
    match parsed.scheme() {
        "http" | "https" if parsed.host().is_some() => Ok(()),
        "http" | "https" => Err(format!("{url:?} has no host")),
        other => Err(format!("{url:?} has scheme {other:?}; only http:// and https:// are supported")),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolsFile {
    #[serde(default)]
    webhook: Vec<WebhookConfig>,
}

/// Reads the operator's tools file (TOML, `[[webhook]]` tables) and checks
/// every entry; the error names the file and the entry.
pub fn load_tools_file(path: &Path) -> Result<Vec<WebhookConfig>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("tools file {}: {e}", path.display()))?;
    parse_tools_file(&text).map_err(|e| format!("tools file {}: {e}", path.display()))
}

fn parse_tools_file(text: &str) -> Result<Vec<WebhookConfig>, String> {
    let file: ToolsFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut seen = HashSet::new();
    for (i, w) in file.webhook.iter().enumerate() {
        let entry = format!("webhook #{} ({:?})", i + 1, w.name);
        w.check().map_err(|e| format!("{entry}: {e}"))?;
        if !seen.insert(w.name.as_str()) {
            return Err(format!("{entry}: the name is used by an earlier webhook"));
        }
    }
    Ok(file.webhook)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"
[[webhook]]
name = "weather"
url = "http://127.0.0.1:9000/weather"
description = "Today's weather for a city"
[webhook.headers]
Authorization = "Bearer secret"

[[webhook]]
name = "send_mail-2"
url = "http://mail.internal/send"
timeout_ms = 2500
max_response_bytes = 4096
"#;

    #[test]
    fn a_good_file_parses_with_defaults() {
        let hooks = parse_tools_file(GOOD).unwrap();
        assert_eq!(hooks.len(), 2);
        assert_eq!(hooks[0].name, "weather");
        assert_eq!(hooks[0].timeout_ms, WEBHOOK_TIMEOUT_MS_DEFAULT);
        assert_eq!(hooks[0].max_response_bytes, WEBHOOK_RESPONSE_BYTES_DEFAULT);
        assert_eq!(hooks[0].headers["Authorization"], "Bearer secret");
        assert_eq!(hooks[1].timeout_ms, 2500);
        assert_eq!(hooks[1].max_response_bytes, 4096);
        assert!(!format!("{:?}", hooks[0]).contains("secret"), "Debug must not print header values");
        assert!(parse_tools_file("").unwrap().is_empty());
    }

    #[test]
    fn a_duplicate_name_is_refused() {
        let text = format!("{GOOD}\n[[webhook]]\nname = \"weather\"\nurl = \"http://other/\"\n");
        let e = parse_tools_file(&text).unwrap_err();
        assert!(e.contains("webhook #3 (\"weather\")") && e.contains("used by an earlier webhook"), "{e}");
    }

    #[test]
    fn bad_urls_are_refused() {
        for (url, why) in [("not a url", "is not a URL"), ("ftp://files/x", "only http://")] {
            let e = parse_tools_file(&format!("[[webhook]]\nname = \"w\"\nurl = \"{url}\"\n")).unwrap_err();
            assert!(e.contains("webhook #1 (\"w\"): url:") && e.contains(why), "{url}: {e}");
        }
    }

    #[test]
    fn the_name_llm_and_bad_names_are_refused() {
        let e = parse_tools_file("[[webhook]]\nname = \"llm\"\nurl = \"http://x/\"\n").unwrap_err();
        assert!(e.contains("the host's model tool"), "{e}");
        let e = parse_tools_file("[[webhook]]\nname = \"Bad Name\"\nurl = \"http://x/\"\n").unwrap_err();
        assert!(e.contains("must be 1-64 characters"), "{e}");
    }

    #[test]
    fn limits_headers_and_unknown_fields_are_checked() {
        let e = parse_tools_file("[[webhook]]\nname = \"w\"\nurl = \"http://x/\"\ntimeout_ms = 0\n").unwrap_err();
        assert!(e.contains("timeout_ms must be 1 to"), "{e}");
        let e = parse_tools_file("[[webhook]]\nname = \"w\"\nurl = \"http://x/\"\nmax_response_bytes = 999999999\n")
            .unwrap_err();
        assert!(e.contains("max_response_bytes must be 1 to"), "{e}");
        let e =
            parse_tools_file("[[webhook]]\nname = \"w\"\nurl = \"http://x/\"\nheaders = { Idempotency-Key = \"k\" }\n")
                .unwrap_err();
        assert!(e.contains("set by the host"), "{e}");
        let e = parse_tools_file("[[webhook]]\nname = \"w\"\nurl = \"http://x/\"\ntimeout = 5\n").unwrap_err();
        assert!(e.contains("unknown field `timeout`"), "{e}");
    }

    #[test]
    fn load_names_the_file() {
        let path = std::env::temp_dir().join(format!("agent-host-tools-{}.toml", uuid::Uuid::new_v4()));
        let e = load_tools_file(&path).unwrap_err();
        assert!(e.starts_with(&format!("tools file {}:", path.display())), "{e}");
        std::fs::write(&path, GOOD).unwrap();
        let loaded = load_tools_file(&path);
        std::fs::remove_file(&path).unwrap();
        assert_eq!(loaded.unwrap().len(), 2);
    }
}
