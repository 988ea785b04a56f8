//! The one rule for text a client sends toward the database: PostgreSQL
//! stores neither U+0000 in `text` nor `\u0000` in `jsonb`, so such text is
//! refused before it gets there, naming its field, instead of failing in the
//! driver (a 500 that told the client nothing). What comes from guests, tools
//! and models is the run core's to make storable; this is the edge's half.

use serde_json::Value;

/// A field holds U+0000.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{field} contains U+0000, which cannot be stored")]
pub struct Unstorable {
    pub field: &'static str,
}

/// `s` as a value of `field`.
pub fn text(field: &'static str, s: &str) -> Result<(), Unstorable> {
    match s.contains('\0') {
        true => Err(Unstorable { field }),
        false => Ok(()),
    }
}

/// Every string in `v`, object keys included, as parts of `field`. Walks
/// with its own stack: the depth of `v` costs no recursion.
pub fn json(field: &'static str, v: &Value) -> Result<(), Unstorable> {
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => text(field, s)?,
            Value::Array(items) => stack.extend(items),
            Value::Object(map) => {
                for (key, value) in map {
                    text(field, key)?;
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
    use super::*;
    use serde_json::json;

    #[test]
    fn u0000_anywhere_in_json_is_found_and_named() {
        assert_eq!(text("content", "a\0b"), Err(Unstorable { field: "content" }));
        assert_eq!(text("content", "a\u{fffd}b"), Ok(()));
        for v in [json!({ "k": "\u{0}" }), json!({ "\u{0}": 1 }), json!([1, [{ "a": { "b\u{0}c": null } }]])] {
            assert_eq!(json("config", &v), Err(Unstorable { field: "config" }), "{v}");
        }
        assert_eq!(json("config", &json!({ "k": ["fine", 1, true, null, { "x": "y" }] })), Ok(()));
        let e = Unstorable { field: "content" };
        assert_eq!(e.to_string(), "content contains U+0000, which cannot be stored");
    }
}
