//! What the operator configures: the model endpoint and the tools file
//! (webhooks, MCP servers, `http` rules, secrets). Everything is checked when the host starts, so a typo is a refusal
//! to start rather than every run failing later.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::Path;
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use serde::Deserialize;

use super::checks::{check_call_limits, check_http_url, Secrets, SECRET_BYTES_MIN};
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
const WEBHOOK_RESPONSE_BYTES_DEFAULT: u64 = 1 << 20;

/// Headers the host sets itself on every webhook call.
const HOST_HEADERS: &[&str] = &["content-type", "content-length", "host", "idempotency-key", "transfer-encoding"];

/// One operator-defined webhook tool (a `[[webhook]]` table of the tools file).
#[derive(Clone, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// The name guests call it by (and manifests grant).
    pub name: String,
    /// The only URL this tool ever calls.
    pub url: String,
    /// One call, end to end, in milliseconds.
    #[serde(default = "webhook_timeout_ms_default")]
    pub timeout_ms: u64,
    /// Bytes of one answer; a longer one fails the call.
    #[serde(default = "webhook_response_bytes_default")]
    pub max_response_bytes: u64,
    /// Sent with every call (credentials such as `Authorization`); never
    /// shown to guests.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
    /// What the tool does, as the model reads it.
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
    pub approval: Option<Approval>,
    /// The tenants whose own plugins may use it (`["*"]`: every tenant);
    /// unset: as `--tenant-tools` says (none by default). Published plugins
    /// (the operator's) may use every tool.
    #[serde(default)]
    pub tenants: Option<Vec<String>>,
    /// Retries of a failed call, within `timeout_ms`: a call that could not
    /// connect (the receiver never saw it) always; one answered 408, 429 or
    /// 5xx only when the tool is `idempotent` (the receiver may have acted);
    /// any other answer never. Each retried attempt is journaled
    /// (`tool_attempt`). Unset: one attempt.
    #[serde(default)]
    pub retry: Option<super::models::RetryConfig>,
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
            .field("tenants", &self.tenants)
            .field("retry", &self.retry)
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
        if [super::AWAIT_AGENTS, super::TAKE_INSTRUCTIONS].contains(&self.name.as_str()) {
            return Err(format!("name {:?} is answered by the run host itself", self.name));
        }
        check_http_url(&self.url).map_err(|e| format!("url: {e}"))?;
        check_call_limits(self.timeout_ms, self.max_response_bytes)?;
        if let Some(r) = &self.retry {
            r.check().map_err(|e| format!("retry: {e}"))?;
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

/// The operator's tools file (`--tools-file`, TOML): webhook tools, MCP
/// servers, `http` destinations and the secrets they may use.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ToolsFile {
    /// Webhook tools: each a name guests call and the one URL it posts to.
    #[serde(default)]
    webhook: Vec<WebhookConfig>,
    /// MCP servers (Streamable HTTP) whose tools guests may call as `<server>.<tool>`.
    #[serde(default)]
    mcp: Vec<super::mcp::McpConfig>,
    /// Destinations the `http` tool may reach, with their methods, paths and secrets.
    #[serde(default)]
    http: Vec<super::http::HttpRule>,
    /// Named secrets (`name = "${env:VAR}"`) a guest may place in an `http`
    /// call as `{{secret:name}}`, substituted only for the destinations
    /// whose rule lists them.
    #[serde(default)]
    secrets: BTreeMap<String, String>,
    /// Model providers behind the `llm` tool (beside the one `--llm-base-url`
    /// names, which is the provider `default`).
    #[serde(default)]
    provider: Vec<super::models::ProviderConfig>,
    /// Model aliases: a name a plugin asks for (or `--llm-model`) and the
    /// provider models it is sent to, in order of preference.
    #[serde(default)]
    model: Vec<super::models::ModelAlias>,
    /// Limits on model calls shared by every process on the database: per
    /// provider, or per provider model.
    #[serde(default)]
    limit: Vec<super::models::LimitConfig>,
    /// How model calls are retried (attempts, backoff with jitter).
    #[serde(default)]
    model_retry: Option<super::models::RetryConfig>,
    /// Daily model-token budgets of tenants.
    #[serde(default)]
    budget: Vec<super::models::BudgetConfig>,
    /// Prices of provider models (USD per million tokens): the cost of each call.
    #[serde(default)]
    price: Vec<super::models::PriceConfig>,
}

/// Everything the operator's tools file configures, checked, with every
/// `${env:NAME}` resolved.
#[derive(Default)]
pub struct ToolsConfig {
    pub webhooks: Vec<WebhookConfig>,
    pub mcp: Vec<super::mcp::McpConfig>,
    pub http: Vec<super::http::HttpRule>,
    pub secrets: Secrets,
    /// What an entry naming no `tenants` admits of the tenants' own plugins:
    /// every tenant (true) or none (`--tenant-tools`, none by default).
    pub tenants_default_all: bool,
    /// Model providers, aliases, shared limits and the retry policy.
    pub models: super::models::ModelsConfig,
}

impl fmt::Debug for ToolsConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ToolsConfig")
            .field("webhooks", &self.webhooks)
            .field("mcp", &self.mcp.iter().map(|m| &m.name).collect::<Vec<_>>())
            .field("http", &self.http.len())
            .field("secrets", &self.secrets)
            .finish()
    }
}

/// `text` with each `${env:NAME}` replaced by that variable's value (looked
/// up with `env`); with `secrets`, each value is a secret remembered for
/// redaction and must be at least [`SECRET_BYTES_MIN`] bytes. A variable
/// that is not set is an error naming it.
fn expand_env(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
    secrets: Option<&mut Secrets>,
) -> Result<String, String> {
    let mut secrets = secrets;
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find("${env:") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 6..];
        let end = after.find('}').ok_or_else(|| "an unterminated ${env:...}".to_string())?;
        let name = &after[..end];
        let valid = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_');
        if !valid {
            return Err(format!("${{env:{name}}} does not name an environment variable"));
        }
        let value = env(name).ok_or_else(|| format!("environment variable {name} is not set"))?;
        if let Some(secrets) = secrets.as_deref_mut() {
            if value.len() < SECRET_BYTES_MIN {
                return Err(format!(
                    "environment variable {name} holds {} bytes; a secret must be at least {SECRET_BYTES_MIN}",
                    value.len()
                ));
            }
            secrets.add_value(&value);
        }
        out.push_str(&value);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Reads the operator's tools file (TOML: `[[webhook]]`, `[[mcp]]`,
/// `[[http]]` tables and `[secrets]`), resolves `${env:NAME}` from the
/// process's environment and checks every entry; the error names the file
/// and the entry.
pub fn load_tools_file(path: &Path) -> Result<ToolsConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("tools file {}: {e}", path.display()))?;
    parse_tools_file_with(&text, &|name| std::env::var(name).ok())
        .map_err(|e| format!("tools file {}: {e}", path.display()))
}

#[cfg(test)]
fn parse_tools_file(text: &str) -> Result<Vec<WebhookConfig>, String> {
    parse_tools_file_with(text, &|_| None).map(|c| c.webhooks)
}

/// Resolves `${env:NAME}` in an entry's URL (not a secret: hosts and ports
/// are not redacted) and in its header values (secrets). A header value
/// written literally in the file is a secret too (and so is its credential,
/// after a scheme such as `Bearer `), when it is at least
/// [`SECRET_BYTES_MIN`] bytes; headers that carry no credential (`Accept`,
/// `User-Agent`, ...) are not, lest their common values be cut out of answers.
fn expand_entry(
    url: &mut String,
    headers: &mut BTreeMap<String, String>,
    env: &dyn Fn(&str) -> Option<String>,
    secrets: &mut Secrets,
) -> Result<(), String> {
    const PLAIN: &[&str] = &["accept", "accept-encoding", "accept-language", "cache-control", "user-agent"];
    *url = expand_env(url, env, None).map_err(|e| format!("url: {e}"))?;
    for (k, v) in headers.iter_mut() {
        let literal = !v.contains("${env:") && !PLAIN.contains(&k.to_ascii_lowercase().as_str());
        *v = expand_env(v, env, Some(secrets)).map_err(|e| format!("header {k:?}: {e}"))?;
        if literal {
            let credential = v.split_once(' ').map(|(_, c)| c.trim());
            for value in std::iter::once(v.as_str()).chain(credential) {
                if value.len() >= SECRET_BYTES_MIN {
                    secrets.add_value(value);
                }
            }
        }
    }
    Ok(())
}

/// A tools file's text, checked, with `${env:NAME}` looked up with `env`
/// (what [`load_tools_file`] does with the process's environment).
pub fn parse_tools_file_with(text: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<ToolsConfig, String> {
    let mut file: ToolsFile = toml::from_str(text).map_err(|e| e.to_string())?;
    let mut secrets = Secrets::default();
    let mut names = HashSet::new();
    for (i, w) in file.webhook.iter_mut().enumerate() {
        let entry = format!("webhook #{} ({:?})", i + 1, w.name);
        expand_entry(&mut w.url, &mut w.headers, env, &mut secrets).map_err(|e| format!("{entry}: {e}"))?;
        w.check().map_err(|e| format!("{entry}: {e}"))?;
        if !names.insert(w.name.clone()) {
            return Err(format!("{entry}: the name is used by an earlier webhook"));
        }
    }
    for (i, m) in file.mcp.iter_mut().enumerate() {
        let entry = format!("mcp #{} ({:?})", i + 1, m.name);
        expand_entry(&mut m.url, &mut m.headers, env, &mut secrets).map_err(|e| format!("{entry}: {e}"))?;
        m.check().map_err(|e| format!("{entry}: {e}"))?;
        if !names.insert(m.name.clone()) {
            return Err(format!("{entry}: the name is used by an earlier entry"));
        }
    }
    for (name, value) in &file.secrets {
        let valid = (1..=64).contains(&name.len())
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'_' || b == b'-');
        if !valid {
            return Err(format!("secret {name:?}: a name is 1-64 characters of a-z, 0-9, _ and -"));
        }
        let value = expand_env(value, env, Some(&mut secrets)).map_err(|e| format!("secret {name:?}: {e}"))?;
        if value.len() < SECRET_BYTES_MIN {
            return Err(format!(
                "secret {name:?} is {} bytes; a secret must be at least {SECRET_BYTES_MIN}",
                value.len()
            ));
        }
        secrets.insert(name, &value);
    }
    if !file.http.is_empty() && names.contains(super::HTTP_TOOL) {
        return Err(format!("the name {:?} is the host's http tool", super::HTTP_TOOL));
    }
    for (i, rule) in file.http.iter().enumerate() {
        rule.check(&secrets).map_err(|e| format!("http rule #{} ({:?}): {e}", i + 1, rule.url))?;
    }
    for (i, p) in file.provider.iter_mut().enumerate() {
        let entry = format!("provider #{} ({:?})", i + 1, p.name);
        p.base_url = expand_env(&p.base_url, env, None).map_err(|e| format!("{entry}: base_url: {e}"))?;
        if let Some(key) = &p.api_key {
            let literal = !key.contains("${env:");
            let key = expand_env(key, env, Some(&mut secrets)).map_err(|e| format!("{entry}: api_key: {e}"))?;
            if literal && key.len() >= SECRET_BYTES_MIN {
                secrets.add_value(&key);
            }
            p.api_key = Some(key);
        }
    }
    let models = super::models::ModelsConfig {
        providers: file.provider,
        aliases: file.model,
        limits: file.limit,
        retry: file.model_retry.unwrap_or_default(),
        budgets: file.budget,
        prices: file.price,
    };
    models.check()?;
    Ok(ToolsConfig {
        webhooks: file.webhook,
        mcp: file.mcp,
        http: file.http,
        secrets,
        tenants_default_all: false,
        models,
    })
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
        assert_eq!(loaded.unwrap().webhooks.len(), 2);
    }
}

#[cfg(test)]
mod secret_tests {
    use super::*;

    fn env(name: &str) -> Option<String> {
        match name {
            "WEATHER_KEY" => Some("wk-12345".into()),
            "MCP_TOKEN" => Some("tok\"en-678".into()),
            _ => None,
        }
    }

    const FILE: &str = r#"
[secrets]
weather_key = "${env:WEATHER_KEY}"

[[webhook]]
name = "hook"
url = "http://127.0.0.1:9/hook"
headers = { Authorization = "Bearer ${env:MCP_TOKEN}" }

[[mcp]]
name = "docs"
url = "http://127.0.0.1:9/mcp"
headers = { Authorization = "Bearer ${env:MCP_TOKEN}" }

[[http]]
url = "https://api.weather.example"
methods = ["GET"]
paths = ["/v1/*"]
secrets = ["weather_key"]
"#;

    #[test]
    fn env_references_resolve_and_are_redacted() {
        let c = parse_tools_file_with(FILE, &env).unwrap();
        assert_eq!(c.secrets.get("weather_key"), Some("wk-12345"));
        assert_eq!(c.webhooks[0].headers["Authorization"], "Bearer tok\"en-678");
        assert_eq!(c.mcp[0].headers["Authorization"], "Bearer tok\"en-678");
        let text = json_text();
        assert_eq!(c.secrets.redact(&text), r#"{"a":"<redacted>","b":"x <redacted> y"}"#);
        assert!(!format!("{c:?}").contains("wk-12345") && !format!("{c:?}").contains("678"), "{c:?}");
    }

    fn json_text() -> String {
        serde_json::json!({ "a": "wk-12345", "b": "x tok\"en-678 y" }).to_string()
    }

    #[test]
    fn redaction_walks_strings_and_keys_and_leaves_json_valid() {
        let env = |name: &str| match name {
            "KEY" => Some("8080-secret-value".to_string()),
            "PORT" => Some("8080".to_string()),
            _ => None,
        };
        let file = "[secrets]\nk = \"${env:KEY}\"\n[[mcp]]\nname = \"m\"\nurl = \"http://127.0.0.1:${env:PORT}/mcp\"\n";
        let c = parse_tools_file_with(file, &env).unwrap();
        assert_eq!(c.mcp[0].url, "http://127.0.0.1:8080/mcp");
        // The URL's port is not a secret: numbers and strings holding it stay.
        let answer = serde_json::json!({ "port": 8080, "url": "http://x:8080/", "8080-secret-value": ["a 8080-secret-value b"] });
        let redacted = c.secrets.redact_value(answer);
        assert_eq!(
            redacted,
            serde_json::json!({ "port": 8080, "url": "http://x:8080/", "<redacted>": ["a <redacted> b"] })
        );
        assert!(serde_json::from_str::<serde_json::Value>(&redacted.to_string()).is_ok());
    }

    #[test]
    fn a_short_secret_is_refused_at_start() {
        let env = |_: &str| Some("short".to_string());
        let e = parse_tools_file_with("[secrets]\nk = \"${env:S}\"\n", &env).unwrap_err();
        assert_eq!(e, "secret \"k\": environment variable S holds 5 bytes; a secret must be at least 8");
        let e = parse_tools_file_with("[secrets]\nk = \"abc\"\n", &env).unwrap_err();
        assert_eq!(e, "secret \"k\" is 3 bytes; a secret must be at least 8");
        let file = "[[webhook]]\nname = \"w\"\nurl = \"http://x/\"\nheaders = { X-Key = \"${env:S}\" }\n";
        let e = parse_tools_file_with(file, &env).unwrap_err();
        assert!(e.starts_with("webhook #1 (\"w\"): header \"X-Key\": environment variable S holds 5 bytes"), "{e}");
    }

    #[test]
    fn a_missing_variable_is_named() {
        let e = parse_tools_file_with(FILE, &|_| None).unwrap_err();
        assert_eq!(e, "webhook #1 (\"hook\"): header \"Authorization\": environment variable MCP_TOKEN is not set");
        let e = parse_tools_file_with("[secrets]\nk = \"${env:NOPE_X}\"\n", &|_| None).unwrap_err();
        assert_eq!(e, "secret \"k\": environment variable NOPE_X is not set");
        let e = parse_tools_file_with("[secrets]\nk = \"${env:bad-name}\"\n", &|_| None).unwrap_err();
        assert!(e.contains("does not name an environment variable"), "{e}");
    }

    /// Issue 40: a header value written in the file itself is redacted like
    /// one from the environment (and so is its credential after `Bearer `).
    #[test]
    fn literal_header_values_are_redacted() {
        let file = r#"
[[webhook]]
name = "hook"
url = "http://127.0.0.1:9/hook"
headers = { Authorization = "Bearer literal-hook-token", X-Short = "abc", Accept = "application/json" }

[[mcp]]
name = "docs"
url = "http://127.0.0.1:9/mcp"
headers = { X-Api-Key = "mcp-literal-key" }
"#;
        let c = parse_tools_file_with(file, &|_| None).unwrap();
        assert_eq!(c.webhooks[0].headers["Authorization"], "Bearer literal-hook-token");
        let said =
            "sent Bearer literal-hook-token, echoed literal-hook-token, key mcp-literal-key, abc, application/json";
        assert_eq!(c.secrets.redact(said), "sent <redacted>, echoed <redacted>, key <redacted>, abc, application/json");
        let answer = serde_json::json!({ "k": "mcp-literal-key" });
        assert_eq!(c.secrets.redact_value(answer), serde_json::json!({ "k": "<redacted>" }));
        // Without the literal values there is nothing to redact.
        let c = parse_tools_file_with("[[webhook]]\nname = \"w\"\nurl = \"http://x/\"\n", &|_| None).unwrap();
        assert!(c.secrets.is_empty());
    }

    #[test]
    fn an_http_rule_may_bind_only_known_secrets() {
        let text = "[[http]]\nurl = \"https://a.example\"\nsecrets = [\"nope\"]\n";
        let e = parse_tools_file_with(text, &|_| None).unwrap_err();
        assert!(e.contains("http rule #1") && e.contains("secret \"nope\" is not in [secrets]"), "{e}");
    }
}

/// Whether a tool's calls wait for a person's approval: a tools-file entry's
/// `approval`, and a manifest's `approval` map.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum Approval {
    Always,
    Never,
}
