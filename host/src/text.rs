//! The one rule for text on its way into the database: PostgreSQL stores
//! neither U+0000 in `text` nor the `\u0000` escape in `jsonb`. What comes
//! from guests, tools and models has it replaced with U+FFFD (and counted by
//! the caller) instead of failing the write and with it the run
//! ([`storable`], [`storable_json`]); what comes from clients is refused at
//! the edge, naming its field (422: [`refuse_text`], [`refuse_json`])
//! instead of failing in the driver. Also the bounds on stored text.

use std::borrow::Cow;

use serde_json::Value;

/// Whether `s` holds no U+0000 (PostgreSQL can store it as `text`).
pub fn is_storable(s: &str) -> bool {
    !s.contains('\0')
}

/// `s` with every U+0000 replaced by U+FFFD.
pub fn storable(s: &str) -> Cow<'_, str> {
    if !is_storable(s) {
        Cow::Owned(s.replace('\0', "\u{FFFD}"))
    } else {
        Cow::Borrowed(s)
    }
}

/// The most bytes of a run's final answer that are stored (as its
/// assistant message, in the Responses view and in webhooks): a longer one
/// is cut ([`cut`]), never a failure of the store.
pub const ANSWER_BYTES_MAX: usize = 1 << 20;
/// The most bytes of a run's error that are stored.
pub const ERROR_BYTES_MAX: usize = 16 << 10;

/// `s` cut to at most `max` bytes at a character boundary, with a marker
/// saying how much was cut (the marker fits within `max`).
pub fn cut(s: &str, max: usize) -> Cow<'_, str> {
    if s.len() <= max {
        return Cow::Borrowed(s);
    }
    // The marker's length with the widest count it could carry.
    let room = max.saturating_sub(marker(s.len()).len());
    let mut end = room.min(s.len());
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    Cow::Owned(format!("{}{}", &s[..end], marker(s.len() - end)))
}

fn marker(bytes_cut: usize) -> String {
    format!(" [… {bytes_cut} bytes cut]")
}

/// `s` with every U+0000 dropped: for text the host writes into a
/// statement itself (an SQL literal), where PostgreSQL could not take it.
pub fn without_nul(s: &str) -> Cow<'_, str> {
    if is_storable(s) {
        Cow::Borrowed(s)
    } else {
        Cow::Owned(s.replace('\0', ""))
    }
}

/// How many U+0000 `s` holds.
pub fn nul_count(s: &str) -> usize {
    s.bytes().filter(|b| *b == 0).count()
}

/// Makes every string and key of `v` storable; returns how many characters
/// were replaced.
pub fn storable_json(v: &mut Value) -> usize {
    match v {
        Value::String(s) => {
            let n = nul_count(s);
            if n > 0 {
                *s = s.replace('\0', "\u{FFFD}");
            }
            n
        }
        Value::Array(items) => items.iter_mut().map(storable_json).sum(),
        Value::Object(map) => {
            let mut n: usize = map.values_mut().map(storable_json).sum();
            if map.keys().any(|k| k.contains('\0')) {
                let old = std::mem::take(map);
                for (k, v) in old {
                    n += nul_count(&k);
                    map.insert(k.replace('\0', "\u{FFFD}"), v);
                }
            }
            n
        }
        _ => 0,
    }
}

/// The size of `v` as JSON text, without building the text.
pub fn json_bytes(v: &Value) -> usize {
    struct Count(usize);
    impl std::io::Write for Count {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.len();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut c = Count(0);
    serde_json::to_writer(&mut c, v).expect("a Value serializes");
    c.0
}

/// A field holds U+0000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} contains U+0000, which cannot be stored")]
pub struct Unstorable {
    pub field: &'static str,
}

/// `s` as a value of `field`.
pub fn refuse_text(field: &'static str, s: &str) -> Result<(), Unstorable> {
    match is_storable(s) {
        false => Err(Unstorable { field }),
        true => Ok(()),
    }
}

/// Every string in `v`, object keys included, as parts of `field`. Walks
/// with its own stack: the depth of `v` costs no recursion.
pub fn refuse_json(field: &'static str, v: &Value) -> Result<(), Unstorable> {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => refuse_text(field, s)?,
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                for (key, value) in map {
                    refuse_text(field, key)?;
                    stack.push(value);
                }
            }
            Value::Null | Value::Bool(_) | Value::Number(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn nul_becomes_the_replacement_character_everywhere() {
        assert_eq!(storable("before\0after"), "before\u{FFFD}after");
        assert!(matches!(storable("clean"), Cow::Borrowed(_)));
        let mut v = json!({ "delta": "a\u{0}b", "nested": [{ "k\u{0}": "\u{0}\u{0}" }], "n": 1 });
        assert_eq!(storable_json(&mut v), 4);
        assert_eq!(v, json!({ "delta": "a\u{FFFD}b", "nested": [{ "k\u{FFFD}": "\u{FFFD}\u{FFFD}" }], "n": 1 }));
        assert_eq!(json_bytes(&v), v.to_string().len());
    }

    #[test]
    fn a_long_text_is_cut_at_a_character_boundary_with_a_marker_within_the_bound() {
        assert!(matches!(cut("short", 100), Cow::Borrowed("short")));
        let long = "é".repeat(1000); // 2,000 bytes
        let c = cut(&long, 101);
        assert!(c.len() <= 101, "{}", c.len());
        assert!(c.ends_with(" bytes cut]"), "{c}");
        let kept = c.split(" [… ").next().unwrap();
        assert!(kept.chars().all(|ch| ch == 'é'));
        let said: usize = c.rsplit(" [… ").next().unwrap().trim_end_matches(" bytes cut]").parse().unwrap();
        assert_eq!(kept.len() + said, long.len());
    }
}

#[cfg(test)]
mod refusal_tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn u0000_anywhere_in_json_is_found_and_named() {
        assert_eq!(refuse_text("content", "a\0b"), Err(Unstorable { field: "content" }));
        assert_eq!(refuse_text("content", "a\u{fffd}b"), Ok(()));
        for v in [json!({ "k": "\u{0}" }), json!({ "\u{0}": 1 }), json!([1, [{ "a": { "b\u{0}c": null } }]])] {
            assert_eq!(refuse_json("config", &v), Err(Unstorable { field: "config" }), "{v}");
        }
        assert_eq!(refuse_json("config", &json!({ "k": ["fine", 1, true, null, { "x": "y" }] })), Ok(()));
        let e = Unstorable { field: "content" };
        assert_eq!(e.to_string(), "content contains U+0000, which cannot be stored");
    }
}
