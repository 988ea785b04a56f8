//! Cursor paging for the list routes: `?limit=N&after=<cursor>` in, the
//! array and `next_cursor` (null at the end) out. A cursor is opaque to
//! clients (hex of the last item's key); each list says what its key is.

use serde::Deserialize;

use super::ApiError;

/// What any list page holds at most.
pub const LIMIT_MAX: usize = 1000;
/// Bytes of a decoded cursor.
const CURSOR_BYTES_MAX: usize = 256;

/// The query of a list route.
#[derive(Debug, Default, Deserialize)]
pub struct PageQuery {
    limit: Option<String>,
    after: Option<String>,
}

/// A checked page request.
#[derive(Debug, Clone)]
pub struct Page {
    pub limit: usize,
    /// The key the cursor carried.
    pub after: Option<String>,
}

impl PageQuery {
    /// A page query read from a route's own query struct.
    pub fn new(limit: Option<String>, after: Option<String>) -> Self {
        PageQuery { limit, after }
    }

    /// `limit` within 1..=[`LIMIT_MAX`] (`default` when absent), `after` a
    /// cursor this API gave.
    pub fn page(&self, default: usize) -> Result<Page, ApiError> {
        let limit = match &self.limit {
            None => default,
            Some(raw) => raw.trim().parse::<usize>().ok().filter(|n| (1..=LIMIT_MAX).contains(n)).ok_or_else(|| {
                ApiError::bad_request(format!("limit must be an integer from 1 to {LIMIT_MAX}, not {raw:?}"))
            })?,
        };
        let after =
            match &self.after {
                None => None,
                Some(raw) => Some(decode(raw).ok_or_else(|| {
                    ApiError::bad_request("after must be a next_cursor this list answered".to_string())
                })?),
            };
        Ok(Page { limit, after })
    }
}

impl Page {
    /// The cursor's key parsed as `T` (a 400 if it is not one).
    pub fn after_as<T: std::str::FromStr>(&self) -> Result<Option<T>, ApiError> {
        self.after
            .as_deref()
            .map(|k| k.parse().map_err(|_| ApiError::bad_request("after must be a next_cursor this list answered")))
            .transpose()
    }

    /// Rows fetched as `limit + 1`: cut to `limit`, and the cursor after the
    /// last one kept when there were more.
    pub fn finish<T>(&self, rows: &mut Vec<T>, key: impl Fn(&T) -> String) -> Option<String> {
        if rows.len() <= self.limit {
            return None;
        }
        rows.truncate(self.limit);
        rows.last().map(|last| hex::encode(key(last)))
    }

    /// What to fetch: one more than the page, to know whether there is more.
    pub fn fetch(&self) -> i64 {
        self.limit as i64 + 1
    }
}

/// A cursor's key: hex of UTF-8 without U+0000, bounded.
fn decode(raw: &str) -> Option<String> {
    let bytes = hex::decode(raw.trim()).ok().filter(|b| !b.is_empty() && b.len() <= CURSOR_BYTES_MAX)?;
    String::from_utf8(bytes).ok().filter(|k| crate::text::is_storable(k))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(limit: Option<&str>, after: Option<&str>) -> PageQuery {
        PageQuery { limit: limit.map(str::to_string), after: after.map(str::to_string) }
    }

    #[test]
    fn limits_are_bounded_and_cursors_round_trip() {
        assert_eq!(q(None, None).page(100).unwrap().limit, 100);
        assert_eq!(q(Some("1000"), None).page(100).unwrap().limit, 1000);
        for bad in ["0", "1001", "-1", "x", ""] {
            assert!(q(Some(bad), None).page(100).is_err(), "{bad}");
        }
        let page = q(Some("2"), None).page(100).unwrap();
        let mut rows = vec!["a", "b", "c"];
        let cursor = page.finish(&mut rows, |r| r.to_string()).unwrap();
        assert_eq!(rows, ["a", "b"]);
        assert_eq!(q(None, Some(&cursor)).page(100).unwrap().after.as_deref(), Some("b"));
        let mut rows = vec!["a", "b"];
        assert_eq!(page.finish(&mut rows, |r| r.to_string()), None);
        for bad in ["zz", "00", "", "%00", &"61".repeat(CURSOR_BYTES_MAX + 1)] {
            assert!(q(None, Some(bad)).page(100).is_err(), "{bad}");
        }
        let uuid = q(None, Some(&hex::encode("nope"))).page(100).unwrap();
        assert!(uuid.after_as::<uuid::Uuid>().is_err());
    }
}
