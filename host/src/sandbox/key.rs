//! The key of compiled artifacts' MACs. A compiled component is native code
//! run outside the sandbox's checks, so a process loads one (from
//! `plugin_artifact` or its local cache) only when its HMAC-SHA256 under
//! this key matches: whoever can write the database or the cache directory
//! but does not hold the key cannot make a host run code of their choice.
//!
//! Where the key comes from, first match wins:
//! - `AGENT_HOST_ARTIFACT_KEY` (environment, never a command-line value,
//!   which `/proc/*/cmdline` would show), its bytes;
//! - `--artifact-key-file PATH`, the file's contents (surrounding whitespace trimmed);
//! - otherwise `<cache-dir>/artifact.key`, generated on first start (32
//!   random bytes as 64 hex characters, mode 0600, created atomically) and
//!   read by every later process that shares the cache directory.
//!
//! A key shorter than [`KEY_BYTES_MIN`] bytes is refused at start. Each
//! artifact row carries the key's id ([`ArtifactKey::id`]), so hosts with
//! different keys never overwrite nor reject each other's artifacts.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use hmac::Mac;
use rand::RngCore;
use sha2::Digest;

/// Bytes an artifact key has at least.
pub const KEY_BYTES_MIN: usize = 32;
/// The environment variable of the key.
pub const KEY_ENV: &str = "AGENT_HOST_ARTIFACT_KEY";
/// The generated key's file name in the cache directory.
pub const KEY_FILE: &str = "artifact.key";

/// A key for artifacts' MACs and its public id.
#[derive(Clone)]
pub struct ArtifactKey {
    key: Vec<u8>,
    id: String,
}

impl std::fmt::Debug for ArtifactKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ArtifactKey").field("id", &self.id).finish_non_exhaustive()
    }
}

impl ArtifactKey {
    /// `key` from `source` (named in the error), at least [`KEY_BYTES_MIN`] bytes.
    pub fn new(key: Vec<u8>, source: &str) -> Result<ArtifactKey, String> {
        if key.len() < KEY_BYTES_MIN {
            return Err(format!(
                "the artifact key from {source} is {} bytes; it must be at least {KEY_BYTES_MIN} bytes \
                 (e.g. 64 hex characters: `openssl rand -hex 32`)",
                key.len()
            ));
        }
        let id = hex::encode(&sha2::Sha256::digest(&key)[..16]);
        Ok(ArtifactKey { key, id })
    }

    /// The key of a process: [`KEY_ENV`], else `key_file`, else the cache
    /// directory's generated key, else (no cache directory) a random one
    /// for this process only.
    pub fn resolve(key_file: Option<&Path>, cache_dir: Option<&Path>) -> Result<ArtifactKey, String> {
        let env = std::env::var_os(KEY_ENV);
        match (env, key_file) {
            (Some(_), Some(file)) => {
                Err(format!("both {KEY_ENV} and --artifact-key-file {} are set: give one", file.display()))
            }
            (Some(value), None) => ArtifactKey::new(value.into_encoded_bytes(), KEY_ENV),
            (None, Some(file)) => ArtifactKey::from_file(file),
            (None, None) => match cache_dir {
                Some(dir) => ArtifactKey::in_cache_dir(dir),
                None => ArtifactKey::random(),
            },
        }
    }

    /// The contents of `path`, surrounding whitespace trimmed.
    pub fn from_file(path: &Path) -> Result<ArtifactKey, String> {
        let bytes =
            std::fs::read(path).map_err(|e| format!("reading the artifact key file {}: {e}", path.display()))?;
        ArtifactKey::new(bytes.trim_ascii().to_vec(), &path.display().to_string())
    }

    /// A random key no other process has.
    pub fn random() -> Result<ArtifactKey, String> {
        let mut key = [0u8; 32];
        rand::rngs::OsRng.fill_bytes(&mut key);
        ArtifactKey::new(hex::encode(key).into_bytes(), "a random key")
    }

    /// `<dir>/artifact.key`, generated when absent: written whole to a
    /// private temporary file (mode 0600) and hard-linked into place, so
    /// processes starting together agree on one key and none reads half a file.
    pub fn in_cache_dir(dir: &Path) -> Result<ArtifactKey, String> {
        let path = dir.join(KEY_FILE);
        if !path.exists() {
            std::fs::create_dir_all(dir).map_err(|e| format!("cache dir {}: {e}", dir.display()))?;
            let tmp = dir.join(format!("{KEY_FILE}.{}.tmp", uuid::Uuid::new_v4().simple()));
            let written = write_new_key(&tmp).and_then(|_| match std::fs::hard_link(&tmp, &path) {
                Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(e),
                _ => Ok(()),
            });
            let _ = std::fs::remove_file(&tmp);
            written.map_err(|e| format!("generating the artifact key {}: {e}", path.display()))?;
            tracing::info!(path = %path.display(), "generated an artifact key for this cache directory");
        }
        if let Ok(meta) = std::fs::metadata(&path) {
            if meta.permissions().mode() & 0o077 != 0 {
                tracing::warn!(path = %path.display(), "the artifact key file is readable by others: chmod 600 it");
            }
        }
        ArtifactKey::from_file(&path)
    }

    /// The key's public id: the first 16 bytes of its SHA-256, hex.
    pub fn id(&self) -> &str {
        &self.id
    }
}

fn write_new_key(tmp: &PathBuf) -> std::io::Result<()> {
    let key = ArtifactKey::random().map_err(std::io::Error::other)?;
    let mut file = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(tmp)?;
    file.write_all(&key.key)?;
    file.write_all(b"\n")?;
    file.sync_all()
}

/// MACs of artifacts for one key and engine: HMAC-SHA256 over digest,
/// engine hash and bytes. Cheap to clone (for blocking threads).
#[derive(Clone)]
pub struct Macs {
    key: Arc<ArtifactKey>,
    engine_hash: Arc<str>,
}

/// Bytes of a MAC.
pub const MAC_BYTES: usize = 32;

impl Macs {
    pub fn new(key: ArtifactKey, engine_hash: &str) -> Macs {
        Macs { key: Arc::new(key), engine_hash: engine_hash.into() }
    }

    pub fn key_id(&self) -> &str {
        self.key.id()
    }

    fn of(&self, digest: &str, artifact: &[u8]) -> hmac::Hmac<sha2::Sha256> {
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.key.key).expect("HMAC takes any key");
        for part in [digest.as_bytes(), b"\0", self.engine_hash.as_bytes(), b"\0", artifact] {
            mac.update(part);
        }
        mac
    }

    /// The MAC of `digest`'s artifact.
    pub fn mac(&self, digest: &str, artifact: &[u8]) -> Vec<u8> {
        self.of(digest, artifact).finalize().into_bytes().to_vec()
    }

    /// Whether `tag` is this key's MAC of the artifact (constant time).
    pub fn ok(&self, digest: &str, artifact: &[u8], tag: &[u8]) -> bool {
        self.of(digest, artifact).verify_slice(tag).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_key_is_refused_naming_the_rule() {
        let e = ArtifactKey::new(b"short".to_vec(), KEY_ENV).unwrap_err();
        assert!(e.contains("at least 32 bytes") && e.contains(KEY_ENV), "{e}");
        assert!(ArtifactKey::new(vec![b'a'; 32], KEY_ENV).is_ok());
    }

    #[test]
    fn a_cache_dirs_key_is_generated_once_private_and_shared() {
        let dir = std::env::temp_dir().join(format!("agent-host-key-{}", uuid::Uuid::new_v4().simple()));
        let first = ArtifactKey::in_cache_dir(&dir).unwrap();
        let again = ArtifactKey::in_cache_dir(&dir).unwrap();
        assert_eq!(first.id(), again.id());
        assert_eq!(first.id().len(), 32);
        let mode = std::fs::metadata(dir.join(KEY_FILE)).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let other = ArtifactKey::random().unwrap();
        assert_ne!(other.id(), first.id());
        let (a, b) = (Macs::new(first, "e"), Macs::new(other, "e"));
        let tag = a.mac("sha256:x", b"code");
        assert!(a.ok("sha256:x", b"code", &tag));
        assert!(!b.ok("sha256:x", b"code", &tag), "another key's MAC does not pass");
        assert!(!a.ok("sha256:x", b"c0de", &tag));
        let _ = std::fs::remove_dir_all(dir);
    }
}
