//! The fields of every struct in a parsed value, by path (`history[2].action`): the value is serialized
//! into a recorder that keeps, for each struct, the names serde's derive writes and the names it skips
//! (`skip_serializing_if` still announces them through `skip_field`).
//!
//! Key choice: this sees the variant each enum took, so it covers what the type probe (`schema.rs`)
//! cannot: the fields of a `click` action are not those of an `ask`. It sees nothing under a skipped
//! field; the walk then falls back to the type's schema.

use std::cell::RefCell;
use std::collections::HashMap;
use std::fmt;

use serde::ser::{self, Serialize};

/// Struct field names by path, indices included.
#[derive(Debug, Default)]
pub struct Shape {
    structs: HashMap<String, Vec<&'static str>>,
}

impl Shape {
    /// The shape of `value`; a value that fails to serialize leaves what was recorded before it.
    pub fn of<T: Serialize>(value: &T) -> Self {
        let out = RefCell::new(HashMap::new());
        let _ = value.serialize(Recorder { path: String::new(), out: &out });
        Self { structs: out.into_inner() }
    }

    pub fn fields(&self, path: &str) -> Option<&[&'static str]> {
        self.structs.get(path).map(Vec::as_slice)
    }
}

#[derive(Debug)]
pub struct ShapeError(String);

impl fmt::Display for ShapeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ShapeError {}

impl ser::Error for ShapeError {
    fn custom<M: fmt::Display>(msg: M) -> Self {
        Self(msg.to_string())
    }
}

type Out = RefCell<HashMap<String, Vec<&'static str>>>;

fn join(path: &str, key: &str) -> String {
    match path.is_empty() {
        true => key.to_string(),
        false => format!("{path}.{key}"),
    }
}

struct Recorder<'o> {
    path: String,
    out: &'o Out,
}

impl<'o> Recorder<'o> {
    /// `{"variant": ...}` (an externally tagged enum): one field, the variant, then its content.
    fn variant(self, variant: &'static str) -> Recorder<'o> {
        self.out.borrow_mut().insert(self.path.clone(), vec![variant]);
        Recorder { path: join(&self.path, variant), out: self.out }
    }
}

/// Scalars: nothing to record.
macro_rules! leaves {
    ($($method:ident($($ty:ty),*)),* $(,)?) => {
        $(fn $method(self, $(_: $ty),*) -> Result<(), ShapeError> {
            Ok(())
        })*
    };
}

impl<'o> ser::Serializer for Recorder<'o> {
    type Ok = ();
    type Error = ShapeError;
    type SerializeSeq = Items<'o>;
    type SerializeTuple = Items<'o>;
    type SerializeTupleStruct = Items<'o>;
    type SerializeTupleVariant = Items<'o>;
    type SerializeMap = ser::Impossible<(), ShapeError>;
    type SerializeStruct = Fields<'o>;
    type SerializeStructVariant = Fields<'o>;

    leaves! {
        serialize_bool(bool), serialize_i8(i8), serialize_i16(i16), serialize_i32(i32), serialize_i64(i64),
        serialize_u8(u8), serialize_u16(u16), serialize_u32(u32), serialize_u64(u64), serialize_f32(f32),
        serialize_f64(f64), serialize_char(char), serialize_str(&str), serialize_bytes(&[u8]),
        serialize_none(), serialize_unit(), serialize_unit_struct(&'static str),
        serialize_unit_variant(&'static str, u32, &'static str),
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), ShapeError> {
        value.serialize(self)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _: &'static str, value: &T) -> Result<(), ShapeError> {
        value.serialize(self)
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), ShapeError> {
        value.serialize(self.variant(variant))
    }

    fn serialize_seq(self, _: Option<usize>) -> Result<Items<'o>, ShapeError> {
        Ok(Items { path: self.path, next: 0, out: self.out })
    }

    fn serialize_tuple(self, len: usize) -> Result<Items<'o>, ShapeError> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_struct(self, _: &'static str, len: usize) -> Result<Items<'o>, ShapeError> {
        self.serialize_seq(Some(len))
    }

    fn serialize_tuple_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Items<'o>, ShapeError> {
        self.variant(variant).serialize_seq(Some(len))
    }

    /// A map takes any keys: an error ends the map's own serialization, and only that.
    fn serialize_map(self, _: Option<usize>) -> Result<Self::SerializeMap, ShapeError> {
        Err(ShapeError("a map".into()))
    }

    fn serialize_struct(self, _: &'static str, _: usize) -> Result<Fields<'o>, ShapeError> {
        Ok(Fields { path: self.path, names: Vec::new(), out: self.out })
    }

    fn serialize_struct_variant(
        self,
        _: &'static str,
        _: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Fields<'o>, ShapeError> {
        self.variant(variant).serialize_struct("", len)
    }
}

/// The elements of a list, each at its index.
pub struct Items<'o> {
    path: String,
    next: usize,
    out: &'o Out,
}

impl Items<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ShapeError> {
        let path = format!("{}[{}]", self.path, self.next);
        self.next += 1;
        // One element that cannot be recorded must not end the others.
        let _ = value.serialize(Recorder { path, out: self.out });
        Ok(())
    }
}

macro_rules! items {
    ($($trait:ident::$method:ident),*) => {
        $(impl ser::$trait for Items<'_> {
            type Ok = ();
            type Error = ShapeError;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), ShapeError> {
                self.element(value)
            }

            fn end(self) -> Result<(), ShapeError> {
                Ok(())
            }
        })*
    };
}

items!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field
);

/// A struct's field names, written or skipped; each written value recorded under its name.
pub struct Fields<'o> {
    path: String,
    names: Vec<&'static str>,
    out: &'o Out,
}

impl Fields<'_> {
    fn field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), ShapeError> {
        self.names.push(key);
        let _ = value.serialize(Recorder { path: join(&self.path, key), out: self.out });
        Ok(())
    }

    fn finish(self) -> Result<(), ShapeError> {
        self.out.borrow_mut().insert(self.path, self.names);
        Ok(())
    }
}

macro_rules! fields {
    ($($trait:ident),*) => {
        $(impl ser::$trait for Fields<'_> {
            type Ok = ();
            type Error = ShapeError;

            fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), ShapeError> {
                self.field(key, value)
            }

            fn skip_field(&mut self, key: &'static str) -> Result<(), ShapeError> {
                self.names.push(key);
                Ok(())
            }

            fn end(self) -> Result<(), ShapeError> {
                self.finish()
            }
        })*
    };
}

fields!(SerializeStruct, SerializeStructVariant);
