//! The fields a request type accepts at each path, read from the type itself: the type is deserialized
//! from a probe that answers every struct with its own field names (serde's derive hands them to
//! `deserialize_struct`), every list with one element and every option with `Some`, and records the
//! `fields` of each struct under its path with list indices left out (`history[].action`).
//!
//! Key choice: a type that asks for self-describing input (`deserialize_any`: internally tagged and
//! untagged enums, `serde_json::Value`) cannot be probed; the field holding it is left out and the type
//! probed again, so everything around it is still recorded. Such a field's own fields come from the
//! parsed value instead (`shape.rs`).

use std::any::TypeId;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use serde::de::{self, DeserializeOwned, DeserializeSeed, IntoDeserializer, Visitor};

/// The field names of every struct in a type, by path (list indices left out).
#[derive(Debug, Default)]
pub struct Schema {
    structs: HashMap<String, &'static [&'static str]>,
}

impl Schema {
    /// The fields of the struct at `path` (`history[].action`), if the probe reached one there.
    pub fn fields(&self, path: &str) -> Option<&'static [&'static str]> {
        self.structs.get(path).copied()
    }
}

/// The schema of `T`, probed once per type.
pub fn of<T: DeserializeOwned + 'static>() -> Arc<Schema> {
    static CACHE: OnceLock<Mutex<HashMap<TypeId, Arc<Schema>>>> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    if let Some(s) = cache.lock().unwrap_or_else(|p| p.into_inner()).get(&TypeId::of::<T>()) {
        return s.clone();
    }
    let schema = Arc::new(probe::<T>());
    cache.lock().unwrap_or_else(|p| p.into_inner()).insert(TypeId::of::<T>(), schema.clone());
    schema
}

/// What the probe has learnt so far, shared by every probe of one run.
#[derive(Default)]
struct Record {
    structs: HashMap<String, &'static [&'static str]>,
    /// Struct fields (by path) the probe no longer offers: their types cannot be probed.
    skip: HashSet<String>,
    /// The innermost struct field whose value failed in this run.
    failed: Option<String>,
}

/// Probes `T` until no new field fails (each rerun leaves out one more unprobeable field).
fn probe<T: DeserializeOwned>() -> Schema {
    let rec = RefCell::new(Record::default());
    loop {
        rec.borrow_mut().failed = None;
        let ok = T::deserialize(Probe { path: String::new(), rec: &rec }).is_ok();
        let mut r = rec.borrow_mut();
        let retry = match r.failed.take() {
            Some(field) if !ok => r.skip.insert(field),
            _ => false,
        };
        if !retry {
            break;
        }
    }
    Schema { structs: rec.into_inner().structs }
}

#[derive(Debug)]
struct ProbeError(String);

impl fmt::Display for ProbeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ProbeError {}

impl de::Error for ProbeError {
    fn custom<M: fmt::Display>(msg: M) -> Self {
        Self(msg.to_string())
    }
}

fn join(path: &str, key: &str) -> String {
    match path.is_empty() {
        true => key.to_string(),
        false => format!("{path}.{key}"),
    }
}

/// Scalars: a zero, an empty string; the value only has to be accepted.
macro_rules! leaves {
    ($($method:ident => $visit:ident($($value:expr)?)),* $(,)?) => {
        $(fn $method<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
            v.$visit($($value)?)
        })*
    };
}

/// A stand-in for the input at `path`.
struct Probe<'r> {
    path: String,
    rec: &'r RefCell<Record>,
}

impl<'de> de::Deserializer<'de> for Probe<'_> {
    type Error = ProbeError;

    fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, ProbeError> {
        Err(ProbeError(format!("{}: self-describing input", self.path)))
    }

    leaves! {
        deserialize_bool => visit_bool(false),
        deserialize_i8 => visit_i64(0),
        deserialize_i16 => visit_i64(0),
        deserialize_i32 => visit_i64(0),
        deserialize_i64 => visit_i64(0),
        deserialize_i128 => visit_i64(0),
        deserialize_u8 => visit_u64(0),
        deserialize_u16 => visit_u64(0),
        deserialize_u32 => visit_u64(0),
        deserialize_u64 => visit_u64(0),
        deserialize_u128 => visit_u64(0),
        deserialize_f32 => visit_f64(0.0),
        deserialize_f64 => visit_f64(0.0),
        deserialize_char => visit_char('_'),
        deserialize_str => visit_str(""),
        deserialize_string => visit_str(""),
        deserialize_identifier => visit_str(""),
        deserialize_bytes => visit_bytes(b""),
        deserialize_byte_buf => visit_bytes(b""),
        deserialize_unit => visit_unit(),
        deserialize_ignored_any => visit_unit()
    }

    fn deserialize_option<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
        v.visit_some(self)
    }

    fn deserialize_unit_struct<V: Visitor<'de>>(self, _: &'static str, v: V) -> Result<V::Value, ProbeError> {
        v.visit_unit()
    }

    fn deserialize_newtype_struct<V: Visitor<'de>>(self, _: &'static str, v: V) -> Result<V::Value, ProbeError> {
        v.visit_newtype_struct(self)
    }

    fn deserialize_seq<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
        v.visit_seq(Items { path: format!("{}[]", self.path), left: 1, rec: self.rec })
    }

    fn deserialize_tuple<V: Visitor<'de>>(self, len: usize, v: V) -> Result<V::Value, ProbeError> {
        v.visit_seq(Items { path: format!("{}[]", self.path), left: len, rec: self.rec })
    }

    fn deserialize_map<V: Visitor<'de>>(self, v: V) -> Result<V::Value, ProbeError> {
        // Any keys: nothing to record, and an empty map is a valid one.
        v.visit_map(Fields { path: self.path, fields: &[], next: 0, rec: self.rec })
    }

    fn deserialize_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        fields: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.rec.borrow_mut().structs.insert(self.path.clone(), fields);
        v.visit_map(Fields { path: self.path, fields, next: 0, rec: self.rec })
    }

    fn deserialize_enum<V: Visitor<'de>>(
        self,
        _: &'static str,
        variants: &'static [&'static str],
        v: V,
    ) -> Result<V::Value, ProbeError> {
        let first = variants.first().copied().unwrap_or_default();
        v.visit_enum(first.into_deserializer())
    }

    fn deserialize_tuple_struct<V: Visitor<'de>>(
        self,
        _: &'static str,
        len: usize,
        v: V,
    ) -> Result<V::Value, ProbeError> {
        self.deserialize_tuple(len, v)
    }
}

/// A list of `left` probes.
struct Items<'r> {
    path: String,
    left: usize,
    rec: &'r RefCell<Record>,
}

impl<'de> de::SeqAccess<'de> for Items<'_> {
    type Error = ProbeError;

    fn next_element_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<Option<S::Value>, ProbeError> {
        if self.left == 0 {
            return Ok(None);
        }
        self.left -= 1;
        seed.deserialize(Probe { path: self.path.clone(), rec: self.rec }).map(Some)
    }
}

/// A struct's fields, each with a probe for its value (less those that cannot be probed).
struct Fields<'r> {
    path: String,
    fields: &'static [&'static str],
    next: usize,
    rec: &'r RefCell<Record>,
}

impl Fields<'_> {
    fn current(&self) -> String {
        join(&self.path, self.fields[self.next - 1])
    }
}

impl<'de> de::MapAccess<'de> for Fields<'_> {
    type Error = ProbeError;

    fn next_key_seed<K: DeserializeSeed<'de>>(&mut self, seed: K) -> Result<Option<K::Value>, ProbeError> {
        while self.next < self.fields.len() {
            self.next += 1;
            if !self.rec.borrow().skip.contains(&self.current()) {
                return seed.deserialize(self.fields[self.next - 1].into_deserializer()).map(Some);
            }
        }
        Ok(None)
    }

    fn next_value_seed<S: DeserializeSeed<'de>>(&mut self, seed: S) -> Result<S::Value, ProbeError> {
        let path = self.current();
        seed.deserialize(Probe { path: path.clone(), rec: self.rec }).inspect_err(|_| {
            let mut r = self.rec.borrow_mut();
            if r.failed.is_none() {
                r.failed = Some(path);
            }
        })
    }
}
