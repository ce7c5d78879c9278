//! TFRecord files (optionally GZIP-compressed, as AndroidControl is published) and the `tf.train.Example`
//! protos in them, read without TensorFlow or a protobuf compiler.
//!
//! Framing (TensorFlow's `record_writer`): little-endian `u64` length, `u32` masked CRC32C of those 8 bytes, the
//! data, `u32` masked CRC32C of the data; mask `((crc >> 15) | (crc << 17)) + 0xa282ead8`. Both CRCs are checked.
//! A bad data CRC leaves the framing intact, so the next record can still be read; a bad length CRC or a short
//! read cannot be gone past. The protobuf reader decodes the wire format (varint, 64-bit, length-delimited,
//! 32-bit); `tf.train.Example` follows tensorflow/core/example/example.proto and feature.proto: `features` (1) is a
//! map (entries: key 1, value 2) from name to a `Feature`, one of `bytes_list` (1), `float_list` (2) or
//! `int64_list` (3), each a `repeated value = 1`, packed or not.

use std::collections::BTreeMap;
use std::fmt;
use std::io::{self, Read};

// ---------------------------------------------------------------------------------------------------
// CRC32C (Castagnoli, reflected polynomial 0x82f63b78), as TFRecord uses it.

const fn crc32c_table() -> [u32; 256] {
    let mut table = [0u32; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u32;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0x82f6_3b78 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        table[i] = c;
        i += 1;
    }
    table
}

static CRC32C: [u32; 256] = crc32c_table();

pub(super) fn crc32c(bytes: &[u8]) -> u32 {
    !bytes.iter().fold(!0u32, |c, &b| CRC32C[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

/// The CRC as TFRecord stores it (rotated and offset, so a CRC of CRC-bearing data is not trivially zero).
pub(super) fn masked_crc32c(bytes: &[u8]) -> u32 {
    let c = crc32c(bytes);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

// ---------------------------------------------------------------------------------------------------
// Framing.

/// Why a record could not be read.
#[derive(Debug)]
pub(super) enum RecordError {
    /// The file ends inside the record (`where_` says in which part).
    Truncated(&'static str),
    LengthCrc,
    DataCrc,
    Read(io::Error),
}

impl RecordError {
    /// Whether the records after this one can still be read.
    pub(super) fn resumable(&self) -> bool {
        matches!(self, RecordError::DataCrc)
    }
}

impl fmt::Display for RecordError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RecordError::Truncated(part) => write!(f, "the file is truncated: it ends inside the record's {part}"),
            RecordError::LengthCrc => f.write_str("the CRC of the record's length does not match: the file is corrupt"),
            RecordError::DataCrc => f.write_str("the CRC of the record's data does not match: the record is corrupt"),
            RecordError::Read(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                write!(f, "the file is truncated: the compressed stream ends early ({e})")
            }
            RecordError::Read(e) => write!(f, "unreadable ({e})"),
        }
    }
}

/// The records of a TFRecord stream, one at a time; it stops after an error that is not [`resumable`].
///
/// [`resumable`]: RecordError::resumable
pub(super) struct Records<R> {
    r: R,
    stopped: bool,
}

impl<R: Read> Records<R> {
    pub(super) fn new(r: R) -> Self {
        Self { r, stopped: false }
    }

    fn read_record(&mut self) -> Result<Option<Vec<u8>>, RecordError> {
        let mut header = [0u8; 12];
        match read_full(&mut self.r, &mut header).map_err(RecordError::Read)? {
            0 => return Ok(None),
            12 => {}
            _ => return Err(RecordError::Truncated("length header")),
        }
        let len_bytes: [u8; 8] = header[..8].try_into().expect("8 bytes");
        if masked_crc32c(&len_bytes) != u32::from_le_bytes(header[8..].try_into().expect("4 bytes")) {
            return Err(RecordError::LengthCrc);
        }
        let len = u64::from_le_bytes(len_bytes);
        // `take` grows the buffer with the bytes that are there, not with what a corrupt length claims.
        let mut data = Vec::new();
        (&mut self.r).take(len).read_to_end(&mut data).map_err(RecordError::Read)?;
        if (data.len() as u64) < len {
            return Err(RecordError::Truncated("data"));
        }
        let mut footer = [0u8; 4];
        if read_full(&mut self.r, &mut footer).map_err(RecordError::Read)? < 4 {
            return Err(RecordError::Truncated("data CRC"));
        }
        if masked_crc32c(&data) != u32::from_le_bytes(footer) {
            return Err(RecordError::DataCrc);
        }
        Ok(Some(data))
    }
}

impl<R: Read> Iterator for Records<R> {
    type Item = Result<Vec<u8>, RecordError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.stopped {
            return None;
        }
        let r = self.read_record().transpose();
        self.stopped = match &r {
            None => true,
            Some(Err(e)) => !e.resumable(),
            Some(Ok(_)) => false,
        };
        r
    }
}

/// Reads until `buf` is full or the stream ends; returns how many bytes were read.
fn read_full(r: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

// ---------------------------------------------------------------------------------------------------
// Protobuf wire format.

/// One field's value as the wire gives it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum Wire<'a> {
    Varint(u64),
    Fixed64(u64),
    Bytes(&'a [u8]),
    Fixed32(u32),
}

/// The `(field number, value)` pairs of a serialized message, in order.
pub(super) struct Fields<'a> {
    buf: &'a [u8],
    pos: usize,
}

pub(super) fn fields(buf: &[u8]) -> Fields<'_> {
    Fields { buf, pos: 0 }
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let &b = self.buf.get(self.pos).ok_or("the message ends inside a varint")?;
            self.pos += 1;
            v |= ((b & 0x7f) as u64) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }

    fn take(&mut self, n: u64) -> Result<&'a [u8], String> {
        let end = usize::try_from(n).ok().and_then(|n| self.pos.checked_add(n)).filter(|&e| e <= self.buf.len());
        let end = end.ok_or_else(|| format!("a field of {n} bytes runs past the end of the message"))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn field(&mut self) -> Result<(u32, Wire<'a>), String> {
        let key = self.varint()?;
        let number = u32::try_from(key >> 3).map_err(|_| format!("field number {} is out of range", key >> 3))?;
        let value = match key & 7 {
            0 => Wire::Varint(self.varint()?),
            1 => Wire::Fixed64(u64::from_le_bytes(self.take(8)?.try_into().expect("8 bytes"))),
            2 => {
                let n = self.varint()?;
                Wire::Bytes(self.take(n)?)
            }
            5 => Wire::Fixed32(u32::from_le_bytes(self.take(4)?.try_into().expect("4 bytes"))),
            t => return Err(format!("field {number} has wire type {t}, which proto3 messages do not use")),
        };
        Ok((number, value))
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<(u32, Wire<'a>), String>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.pos >= self.buf.len() {
            return None;
        }
        let r = self.field();
        if r.is_err() {
            self.pos = self.buf.len();
        }
        Some(r)
    }
}

/// The varints of a repeated integer field, packed (one length-delimited run) or not.
pub(super) fn push_varints(w: Wire<'_>, out: &mut Vec<u64>) -> Result<(), String> {
    match w {
        Wire::Varint(v) => out.push(v),
        Wire::Bytes(b) => {
            let mut f = Fields { buf: b, pos: 0 };
            while f.pos < b.len() {
                out.push(f.varint()?);
            }
        }
        other => return Err(format!("an integer list holds {other:?}")),
    }
    Ok(())
}

/// A length-delimited field (string, bytes, message).
pub(super) fn bytes_of(w: Wire<'_>) -> Result<&[u8], String> {
    match w {
        Wire::Bytes(b) => Ok(b),
        other => Err(format!("expected a length-delimited field, found {other:?}")),
    }
}

// ---------------------------------------------------------------------------------------------------
// tf.train.Example.

/// One feature of a `tf.train.Example`.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Feature<'a> {
    /// A `Feature` with no list set (TensorFlow reads it as an empty list of any type).
    Empty,
    Bytes(Vec<&'a [u8]>),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
}

impl Feature<'_> {
    /// What it is, with its article ("an int64_list").
    pub(super) fn kind(&self) -> &'static str {
        match self {
            Feature::Empty => "an empty feature",
            Feature::Bytes(_) => "a bytes_list",
            Feature::Floats(_) => "a float_list",
            Feature::Ints(_) => "an int64_list",
        }
    }
}

/// The features of a serialized `tf.train.Example`, by name.
pub(super) fn parse_example(buf: &[u8]) -> Result<BTreeMap<String, Feature<'_>>, String> {
    let mut out = BTreeMap::new();
    for f in fields(buf) {
        let (1, w) = f? else { continue };
        for entry in fields(bytes_of(w).map_err(|e| format!("Example.features: {e}"))?) {
            let (1, w) = entry? else { continue };
            let (name, feature) = map_entry(bytes_of(w)?)?;
            out.insert(name, feature);
        }
    }
    Ok(out)
}

/// One `map<string, Feature>` entry.
fn map_entry(buf: &[u8]) -> Result<(String, Feature<'_>), String> {
    let (mut name, mut feature) = (None, Feature::Empty);
    for f in fields(buf) {
        match f? {
            (1, w) => {
                let s = std::str::from_utf8(bytes_of(w)?).map_err(|_| "a feature name is not UTF-8".to_string())?;
                name = Some(s.to_string());
            }
            (2, w) => feature = parse_feature(bytes_of(w)?)?,
            _ => {}
        }
    }
    let name = name.unwrap_or_default();
    Ok((name, feature))
}

fn parse_feature(buf: &[u8]) -> Result<Feature<'_>, String> {
    let mut feature = Feature::Empty;
    for f in fields(buf) {
        let (kind, w) = f?;
        let list = bytes_of(w)?;
        feature = match kind {
            1 => Feature::Bytes(
                fields(list).filter_map(value_field).map(|w| w.and_then(bytes_of)).collect::<Result<_, _>>()?,
            ),
            2 => Feature::Floats(floats(list)?),
            3 => {
                let mut v = vec![];
                for w in fields(list).filter_map(value_field) {
                    push_varints(w?, &mut v)?;
                }
                Feature::Ints(v.into_iter().map(|x| x as i64).collect())
            }
            _ => continue,
        };
    }
    Ok(feature)
}

/// The `value` (field 1) entries of a list message.
fn value_field(f: Result<(u32, Wire<'_>), String>) -> Option<Result<Wire<'_>, String>> {
    match f {
        Ok((1, w)) => Some(Ok(w)),
        Ok(_) => None,
        Err(e) => Some(Err(e)),
    }
}

fn floats(list: &[u8]) -> Result<Vec<f32>, String> {
    let mut v = vec![];
    for w in fields(list).filter_map(value_field) {
        match w? {
            Wire::Fixed32(x) => v.push(f32::from_bits(x)),
            Wire::Bytes(b) if b.len() % 4 == 0 => {
                v.extend(b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes"))))
            }
            other => return Err(format!("a float_list holds {other:?}")),
        }
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_check_value() {
        // The standard check value of CRC-32C (RFC 3720, appendix B.4).
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(b""), 0);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa, "RFC 3720 B.4: 32 bytes of zeros");
    }

    fn frame(data: &[u8]) -> Vec<u8> {
        let len = (data.len() as u64).to_le_bytes();
        let mut out = len.to_vec();
        out.extend(masked_crc32c(&len).to_le_bytes());
        out.extend(data);
        out.extend(masked_crc32c(data).to_le_bytes());
        out
    }

    #[test]
    fn records_are_read_and_checked() {
        let mut file = frame(b"first");
        file.extend(frame(b""));
        file.extend(frame(b"third"));
        let got: Vec<_> = Records::new(&file[..]).map(|r| r.unwrap()).collect();
        assert_eq!(got, [b"first".to_vec(), vec![], b"third".to_vec()]);

        let mut bad = file.clone();
        bad[12] ^= 1; // first record's data
        let got: Vec<_> = Records::new(&bad[..]).collect();
        assert!(matches!(got[0], Err(RecordError::DataCrc)), "{got:?}");
        assert_eq!(got.len(), 3, "a bad data CRC does not stop the reader");

        let mut bad = file.clone();
        bad[0] ^= 1; // first record's length
        let got: Vec<_> = Records::new(&bad[..]).collect();
        assert!(matches!(got[..], [Err(RecordError::LengthCrc)]), "{got:?}");

        for cut in [5, 14, file.len() - 2] {
            let got: Vec<_> = Records::new(&file[..cut]).collect();
            assert!(matches!(got.last(), Some(Err(RecordError::Truncated(_)))), "cut at {cut}: {got:?}");
        }
    }

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        while v >= 0x80 {
            out.push(v as u8 | 0x80);
            v >>= 7;
        }
        out.push(v as u8);
    }

    /// A length-delimited field.
    fn ld(number: u32, body: &[u8]) -> Vec<u8> {
        let mut out = vec![];
        varint((number as u64) << 3 | 2, &mut out);
        varint(body.len() as u64, &mut out);
        out.extend(body);
        out
    }

    #[test]
    fn wire_format_and_example() {
        // Example { features { feature { key: "n" value { int64_list { value: [1, -2] } } }
        //                      feature { key: "s" value { bytes_list { value: ["a", ""] } } } } }, ints packed.
        let mut packed = vec![];
        varint(1, &mut packed);
        varint(-2i64 as u64, &mut packed);
        let ints = ld(3, &ld(1, &packed));
        let strs = ld(1, &[ld(1, b"a"), ld(1, b"")].concat());
        let entry = |name: &[u8], f: &[u8]| ld(1, &[ld(1, name), ld(2, f)].concat());
        let example = ld(1, &[entry(b"n", &ints), entry(b"s", &strs)].concat());
        let ex = parse_example(&example).unwrap();
        assert_eq!(ex["n"], Feature::Ints(vec![1, -2]));
        assert_eq!(ex["s"], Feature::Bytes(vec![b"a", b""]));
        assert!(parse_example(&example[..example.len() - 1]).unwrap_err().contains("past the end"));
    }
}
