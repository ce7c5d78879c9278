//! Strict request bodies: a field the server does not know, anywhere in a request, is a 400 that names
//! its path and the fields known there (`unknown field `options.max_new_tokens`; the known fields of
//! `options` are: max_tokens, ...`), as OpenAI's API answers an unrecognised argument. A misspelt limit
//! must not be served as if it had been left out. `--lenient-requests` logs such fields instead.
//!
//! Key choice: the known fields are read from the request types, never listed by hand: [`schema`] probes
//! a type for the fields of every struct in it, [`shape`] records the fields of the variants a parsed
//! value took (an `ask` action has other fields than a `click`). The body is parsed as JSON first (the
//! body limit and syntax errors stay with actix's `JsonConfig`), then into the type with the path of any
//! type error (`serde_path_to_error`), then walked against the two.

pub mod schema;
pub mod shape;

use std::future::Future;
use std::pin::Pin;

use actix_web::dev::Payload;
use actix_web::{web, FromRequest, HttpRequest};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;

use crate::error::HttpError;
use crate::state::AppState;
use schema::Schema;
use shape::Shape;

/// Unknown fields named in one message; the rest are counted.
const MAX_SHOWN: usize = 5;
/// Misspellings of a missing field tried before giving up on naming the culprit.
const MAX_RENAMES: usize = 4;

/// A field the request type does not have.
#[derive(Debug, Clone, PartialEq)]
pub struct UnknownField {
    /// Where it is, e.g. `history[2].action.foo`.
    pub path: String,
    /// The object it is in (`""`: the request itself).
    pub parent: String,
    /// The fields that object may have.
    pub known: Vec<&'static str>,
    /// The missing field it most likely stands for, when its absence made the request fail.
    pub meant: Option<String>,
}

impl std::fmt::Display for UnknownField {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let parent = match self.parent.as_str() {
            "" => "the request".to_string(),
            p => format!("`{p}`"),
        };
        write!(f, "unknown field `{}`", self.path)?;
        if let Some(m) = &self.meant {
            write!(f, " (did you mean `{m}`?)")?;
        }
        write!(f, "; the known fields of {parent} are: {}", self.known.join(", "))
    }
}

/// What a body held: the request, or why not, and the fields it should not have.
#[derive(Debug)]
pub struct Checked<T> {
    pub value: Result<T, String>,
    pub unknown: Vec<UnknownField>,
}

/// Parses `body` (the value at `base`, `""` for a whole request) into `T` and finds its unknown fields.
pub fn check<T: DeserializeOwned + Serialize + 'static>(body: &Value, base: &str) -> Checked<T> {
    let schema = schema::of::<T>();
    let value = parse::<T>(body, base);
    let mut unknown = Vec::new();
    let shape = value.as_ref().map(Shape::of).unwrap_or_default();
    walk(body, base, "", &schema, &shape, &mut unknown);
    if let (Err(e), true) = (&value, unknown.is_empty()) {
        unknown.extend(misspelt_required::<T>(body, base, e));
    }
    Checked { value, unknown }
}

/// `T` from `body`, or serde's message with the path where it failed.
fn parse<T: DeserializeOwned>(body: &Value, base: &str) -> Result<T, String> {
    serde_path_to_error::deserialize(body).map_err(|e| {
        let path = match e.path().to_string() {
            p if p == "." => base.to_string(),
            p => under(base, &p),
        };
        match path.is_empty() {
            true => e.inner().to_string(),
            false => format!("{path}: {}", e.inner()),
        }
    })
}

/// `path` with list indices left out, as the schema keys it (`history[2].action` -> `history[].action`).
fn strip_indices(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    let mut in_index = false;
    for c in path.chars() {
        match c {
            '[' => {
                in_index = true;
                out.push_str("[]");
            }
            ']' if in_index => in_index = false,
            _ if in_index => {}
            c => out.push(c),
        }
    }
    out
}

fn join(path: &str, key: &str) -> String {
    match path.is_empty() {
        true => key.to_string(),
        false => format!("{path}.{key}"),
    }
}

/// `rel` (a path inside the value at `base`) as a path in the request.
fn under(base: &str, rel: &str) -> String {
    match rel {
        "" => base.to_string(),
        r if r.starts_with('[') => format!("{base}{r}"),
        r => join(base, r),
    }
}

/// Checks the objects of `v` (at `rel` inside the checked value, `abs` in the request) against the parsed
/// value's shape where it has one, else the type's schema; where neither knows the fields, anything goes.
fn walk(v: &Value, abs: &str, rel: &str, schema: &Schema, shape: &Shape, out: &mut Vec<UnknownField>) {
    match v {
        Value::Object(map) => {
            let known = shape.fields(rel).or_else(|| schema.fields(&strip_indices(rel)));
            let Some(known) = known else { return };
            for (key, child) in map {
                let (abs_child, rel_child) = (join(abs, key), join(rel, key));
                if known.contains(&key.as_str()) {
                    walk(child, &abs_child, &rel_child, schema, shape, out);
                } else {
                    let path = abs_child.chars().take(200).collect();
                    out.push(UnknownField { path, parent: abs.to_string(), known: known.to_vec(), meant: None });
                }
            }
        }
        Value::Array(items) => {
            for (i, item) in items.iter().enumerate() {
                walk(item, &format!("{abs}[{i}]"), &format!("{rel}[{i}]"), schema, shape, out);
            }
        }
        _ => {}
    }
}

/// serde's `missing field `x``, the field's name.
fn missing_field(message: &str) -> Option<&str> {
    let rest = &message[message.rfind("missing field `")? + "missing field `".len()..];
    rest.split('`').next()
}

/// Levenshtein distance, for ranking the keys that may be a misspelt field.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut prev = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let next = (row[j + 1] + 1).min(row[j] + 1).min(prev + usize::from(ca != *cb));
            prev = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// The objects in `v` (at `path`), itself first; at most `MAX_OBJECTS`.
fn objects<'v>(v: &'v Value, path: String, out: &mut Vec<(String, &'v serde_json::Map<String, Value>)>) {
    const MAX_OBJECTS: usize = 64;
    if out.len() >= MAX_OBJECTS {
        return;
    }
    match v {
        Value::Object(map) => {
            out.push((path.clone(), map));
            map.iter().for_each(|(k, c)| objects(c, join(&path, k), out));
        }
        Value::Array(items) => items.iter().enumerate().for_each(|(i, c)| objects(c, format!("{path}[{i}]"), out)),
        _ => {}
    }
}

/// A required field misspelt inside a value whose fields the schema cannot tell (an internally tagged
/// enum, such as an action): the request fails with `missing field `question`` somewhere under the
/// error's path, and the key standing for it is found by renaming the keys closest to the missing name
/// until the request parses.
fn misspelt_required<T: DeserializeOwned + Serialize>(body: &Value, base: &str, error: &str) -> Option<UnknownField> {
    let missing = missing_field(error)?;
    let at = error.rsplit_once(": missing field").map_or("", |(p, _)| p);
    let rel = at.strip_prefix(base).unwrap_or(at).trim_start_matches('.');
    let mut objs = Vec::new();
    objects(pointer(body, rel)?, rel.to_string(), &mut objs);
    let mut candidates: Vec<(usize, &str, &str)> = objs
        .iter()
        .flat_map(|(path, map)| map.keys().map(move |k| (distance(k, missing), path.as_str(), k.as_str())))
        .filter(|(_, _, k)| *k != missing)
        .collect();
    candidates.sort();
    for (_, obj, key) in candidates.into_iter().take(MAX_RENAMES) {
        let mut fixed = body.clone();
        let o = pointer_mut(&mut fixed, obj)?.as_object_mut()?;
        let v = o.remove(key)?;
        o.insert(missing.to_string(), v);
        let Ok(parsed) = serde_json::from_value::<T>(fixed) else { continue };
        let known = Shape::of(&parsed).fields(obj)?.to_vec();
        // A known field that happens to fit the missing one's type is not the culprit.
        if !known.contains(&key) {
            let parent = under(base, obj);
            let path = join(&parent, key);
            return Some(UnknownField { path, parent, known, meant: Some(missing.to_string()) });
        }
    }
    None
}

/// The JSON pointer of a dotted path with indices (`history[1].action` -> `/history/1/action`).
fn to_pointer(path: &str) -> String {
    let mut out = String::new();
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let mut pieces = part.split('[');
        if let Some(key) = pieces.next().filter(|k| !k.is_empty()) {
            out.push('/');
            out.push_str(&key.replace('~', "~0").replace('/', "~1"));
        }
        for index in pieces {
            out.push('/');
            out.push_str(index.trim_end_matches(']'));
        }
    }
    out
}

fn pointer<'v>(v: &'v Value, path: &str) -> Option<&'v Value> {
    v.pointer(&to_pointer(path))
}

fn pointer_mut<'v>(v: &'v mut Value, path: &str) -> Option<&'v mut Value> {
    v.pointer_mut(&to_pointer(path))
}

/// One message for a request's unknown fields (the first few in full).
pub fn unknown_message(unknown: &[UnknownField]) -> String {
    let mut msg: Vec<String> = unknown.iter().take(MAX_SHOWN).map(|u| u.to_string()).collect();
    if unknown.len() > MAX_SHOWN {
        msg.push(format!("and {} more unknown fields", unknown.len() - MAX_SHOWN));
    }
    msg.join("; ")
}

/// `T` from `body` (at `base` in the request), or the 400 naming its unknown fields and its type error.
/// With `lenient`, unknown fields are logged and left out instead.
pub fn from_value<T: DeserializeOwned + Serialize + 'static>(
    body: &Value,
    base: &str,
    lenient: bool,
) -> Result<T, HttpError> {
    let Checked { value, unknown } = check::<T>(body, base);
    let invalid = |e: String| HttpError::bad_request(format!("the body is not a valid request: {e}"));
    if unknown.is_empty() {
        return value.map_err(invalid);
    }
    let msg = unknown_message(&unknown);
    if lenient {
        tracing::warn!(fields = %msg, "ignoring unknown request fields (--lenient-requests)");
        return value.map_err(invalid);
    }
    Err(HttpError::bad_request(match value {
        Ok(_) => msg,
        // A misspelt required field explains the type error; say both.
        Err(e) => format!("{msg} (and: {e})"),
    }))
}

/// A JSON body checked strictly: use in place of `web::Json<T>`.
#[derive(Debug)]
pub struct Strict<T>(pub T);

impl<T> Strict<T> {
    pub fn into_inner(self) -> T {
        self.0
    }
}

/// Whether this server logs unknown fields instead of refusing them.
pub fn lenient(req: &HttpRequest) -> bool {
    req.app_data::<web::Data<AppState>>().is_some_and(|s| s.config.lenient_requests)
}

impl<T: DeserializeOwned + Serialize + 'static> FromRequest for Strict<T> {
    type Error = actix_web::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self, actix_web::Error>>>>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        // The body as JSON first: `JsonConfig` keeps the body limit and the 413/415/400 answers.
        let json = web::Json::<Value>::from_request(req, payload);
        let lenient = lenient(req);
        Box::pin(async move {
            let web::Json(body) = json.await?;
            Ok(Strict(from_value(&body, "", lenient)?))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use askgui_data::agent_api::AgentStepRequest;
    use serde_json::json;

    fn unknown(body: Value) -> Vec<UnknownField> {
        check::<AgentStepRequest>(&body, "").unknown
    }

    fn step(extra: Value) -> Value {
        let mut v = json!({"task": "t", "observation": {"screenshot": "aGk=", "screen": {"width": 4, "height": 3},
            "elements": [{"id": "e1", "bbox": [0, 0, 1, 1]}]},
            "history": [{"turn": "agent", "action": {"action": "click", "x": 1, "y": 2}},
                        {"turn": "agent", "action": {"action": "ask", "question": "Which?"}},
                        {"turn": "say", "text": "That one."}],
            "options": {"max_tokens": 8}});
        json_merge(&mut v, extra);
        v
    }

    /// Sets `patch`'s leaves into `v` (objects merge, anything else replaces).
    fn json_merge(v: &mut Value, patch: Value) {
        match (v, patch) {
            (Value::Object(a), Value::Object(b)) => {
                for (k, p) in b {
                    json_merge(a.entry(k).or_insert(Value::Null), p);
                }
            }
            (slot, p) => *slot = p,
        }
    }

    #[test]
    fn the_schema_is_read_from_the_types() {
        let s = schema::of::<AgentStepRequest>();
        assert_eq!(s.fields(""), Some(&["task", "observation", "history", "adapter", "options"][..]));
        assert_eq!(
            s.fields("options"),
            Some(&["max_tokens", "temperature", "seed", "constrain", "pause_threshold", "coordinates"][..])
        );
        assert_eq!(s.fields("observation"), Some(&["screenshot", "earlier_screenshots", "elements", "screen"][..]));
        assert_eq!(s.fields("observation.elements[]"), Some(&["id", "role", "text", "bbox"][..]));
        assert_eq!(s.fields("observation.screen"), Some(&["width", "height"][..]));
        // Internally tagged: no probe gets in; the parsed value's shape does.
        assert_eq!(s.fields("history[]"), None);
        let req: AgentStepRequest = serde_json::from_value(step(json!({}))).unwrap();
        let shape = Shape::of(&req);
        assert_eq!(shape.fields("history[0].action"), Some(&["action", "x", "y", "element"][..]));
        assert_eq!(shape.fields("history[1].action"), Some(&["action", "question", "options", "kind"][..]));
        assert_eq!(shape.fields("history[2]"), Some(&["turn", "text"][..]));
        assert!(unknown(step(json!({}))).is_empty());
    }

    #[test]
    fn unknown_fields_are_named_with_their_path_and_the_known_fields() {
        let u = unknown(step(json!({"options": {"max_new_tokens": 5}})));
        assert_eq!(u.len(), 1);
        assert_eq!(
            u[0].to_string(),
            "unknown field `options.max_new_tokens`; the known fields of `options` are: max_tokens, temperature, \
             seed, constrain, pause_threshold, coordinates"
        );
        // Options that parse to the defaults are skipped when serialized: the schema still knows them.
        let mut only_unknown = step(json!({}));
        only_unknown["options"] = json!({"max_new_tokens": 5});
        assert_eq!(unknown(only_unknown)[0].path, "options.max_new_tokens");

        let mut v = step(json!({"observation": {"elements": [{"id": "e1", "bbox": [0, 0, 1, 1], "label": "x"}]}}));
        v["history"][0]["action"]["button"] = json!("left");
        v["history"][2]["txet"] = json!(1);
        v["prompt"] = json!("x");
        let paths: Vec<String> = unknown(v).into_iter().map(|u| u.path).collect();
        assert_eq!(
            paths,
            ["history[0].action.button", "history[2].txet", "observation.elements[0].label", "prompt"],
            "serde_json's map is sorted"
        );
    }

    #[test]
    fn a_misspelt_required_field_is_named_even_where_only_the_value_knows_the_fields() {
        let mut v = step(json!({}));
        v["history"][1]["action"] = json!({"action": "ask", "qestion": "Which?", "kind": "selection"});
        let c = check::<AgentStepRequest>(&v, "");
        let e = c.value.unwrap_err();
        assert!(e.contains("history[1]: missing field `question`"), "{e}");
        assert_eq!(c.unknown.len(), 1);
        assert_eq!(
            c.unknown[0].to_string(),
            "unknown field `history[1].action.qestion` (did you mean `question`?); the known fields of \
             `history[1].action` are: action, question, options, kind"
        );
        // A known field of the right type is not taken for a misspelling.
        v["history"][1]["action"] = json!({"action": "ask", "kind": "selection"});
        assert!(check::<AgentStepRequest>(&v, "").unknown.is_empty());
        // Where the schema knows the fields, the walk names the culprit and the type error follows.
        let err = from_value::<AgentStepRequest>(&json!({"tsak": "t", "observation": {}}), "", false).unwrap_err();
        assert!(err.message.starts_with("unknown field `tsak`; the known fields of the request are: task,"), "{err}");
        assert!(err.message.ends_with("(and: missing field `task`)"), "{err}");
    }

    #[test]
    fn lenient_parsing_drops_unknown_fields_and_type_errors_name_their_path() {
        let v = step(json!({"options": {"max_new_tokens": 5}}));
        assert!(from_value::<AgentStepRequest>(&v, "", false).is_err());
        assert_eq!(from_value::<AgentStepRequest>(&v, "", true).unwrap().options.max_tokens, Some(8));
        let bad = step(json!({"observation": {"screen": {"width": "wide"}}}));
        let err = from_value::<AgentStepRequest>(&bad, "", true).unwrap_err();
        assert!(err.message.contains("observation.screen.width: invalid type: string \"wide\""), "{err}");
        // A part of a request, checked on its own, is named from the request's root.
        let err = from_value::<AgentStepRequest>(&json!({"task": "t"}), "messages[0]", false).unwrap_err();
        assert!(err.message.contains("messages[0]: missing field `observation`"), "{err}");
    }

    #[test]
    fn paths_and_pointers() {
        assert_eq!(strip_indices("history[12].action"), "history[].action");
        assert_eq!(strip_indices("a[1][2].b"), "a[][].b");
        assert_eq!(to_pointer("history[1].action"), "/history/1/action");
        assert_eq!(to_pointer(""), "");
        assert_eq!(to_pointer("[3].a/b"), "/3/a~1b");
        assert_eq!(missing_field("history[1]: missing field `text`"), Some("text"));
        assert_eq!(distance("qestion", "question"), 1);
        assert_eq!(distance("", "abc"), 3);
    }
}
