//! Multimodal-Mind2Web's published parquet shards (`data/train-0000x-of-000xx.parquet`, and the test_task,
//! test_website and test_domain ones), read row by row with the parquet crate's record API (no arrow).
//!
//! Only the columns the converter uses are decoded (a projection): `raw_html` and `cleaned_html`, most of a shard's
//! text, are never read. A row becomes the JSON object the JSONL reader sees, so both share one set of checks and
//! messages; the screenshot (the image feature, `struct<bytes: binary, path: string>`) is taken out as raw bytes.
//! A broken file is an error naming the file and row. The parquet crate panics on some corrupt pages (an assertion
//! in its dictionary and bit decoders) and pyarrow writes no page checksums to find them first, so reads go
//! through [`guarded`], which turns such a panic into that error. Rows are counted from 0 in each file, as pyarrow
//! and pandas count them.

use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::record::reader::RowIter;
use parquet::record::{Field, Row};
use parquet::schema::types::Type;

use super::*;

/// The columns the converter reads, and of those the ones a shard must have.
pub(super) const COLUMNS: [&str; 7] = [
    "annotation_id",
    "confirmed_task",
    "target_action_index",
    "action_uid",
    "operation",
    "pos_candidates",
    "target_action_reprs",
];
pub(super) const SCREENSHOT: &str = "screenshot";
const REQUIRED: [&str; 6] =
    ["annotation_id", "confirmed_task", "target_action_index", "operation", "pos_candidates", SCREENSHOT];

/// The parquet files of an input, or `None` for a JSONL file: a `.parquet` file (or one that starts with the
/// parquet magic), or a folder of `*.parquet` shards in name order.
pub(super) fn parquet_files(input: &Path) -> Result<Option<Vec<PathBuf>>, ConvertError> {
    if input.is_dir() {
        let mut files = vec![];
        for entry in fs::read_dir(input).map_err(io_err(input))? {
            let path = entry.map_err(io_err(input))?.path();
            if path.is_file() && path.extension().is_some_and(|e| e == "parquet") {
                files.push(path);
            }
        }
        if files.is_empty() {
            let expected = "`*.parquet` shards of Multimodal-Mind2Web".to_string();
            return Err(ConvertError::NoRecords { input: input.to_path_buf(), expected });
        }
        files.sort();
        return Ok(Some(files));
    }
    let is_parquet = input.extension().is_some_and(|e| e == "parquet") || starts_with_magic(input)?;
    Ok(is_parquet.then(|| vec![input.to_path_buf()]))
}

fn starts_with_magic(path: &Path) -> Result<bool, ConvertError> {
    use std::io::Read;
    let mut head = [0u8; 4];
    let mut file = fs::File::open(path).map_err(io_err(path))?;
    let n = file.read(&mut head).map_err(io_err(path))?;
    Ok(n == 4 && &head == b"PAR1")
}

/// One open shard and the projections the converter reads it with.
pub(super) struct Shard {
    pub path: PathBuf,
    reader: SerializedFileReader<fs::File>,
}

impl Shard {
    /// Opens a shard and checks its columns; an unreadable file or a missing column is a bad record (`None`
    /// when skipped).
    pub fn open(path: &Path, o: &mut Output) -> Result<Option<Shard>, ConvertError> {
        let at = format!("mind2web {}", path.display());
        let file = fs::File::open(path).map_err(io_err(path))?;
        let reader = match guarded(|| SerializedFileReader::new(file)) {
            Ok(r) => r,
            Err(e) => {
                o.bad(&at, &format!("not a readable parquet file ({e})"), "file skipped")?;
                return Ok(None);
            }
        };
        let root = reader.metadata().file_metadata().schema();
        let names: Vec<&str> = root.get_fields().iter().map(|f| f.name()).collect();
        if let Some(missing) = REQUIRED.iter().find(|c| !names.contains(c)) {
            let why = format!("no column `{missing}` (its columns: {})", names.join(", "));
            o.bad(&at, &why, "file skipped")?;
            return Ok(None);
        }
        Ok(Some(Shard { path: path.to_path_buf(), reader }))
    }

    /// Where row `n` is, for messages.
    pub fn at(&self, n: usize) -> String {
        format!("{} row {n}", self.path.display())
    }

    /// The file's schema cut down to `columns` (those it has), in the file's order.
    fn projection(&self, columns: &[&str]) -> Result<Type, String> {
        let root = self.reader.metadata().file_metadata().schema();
        let fields = root.get_fields().iter().filter(|f| columns.contains(&f.name())).cloned().collect();
        Type::group_type_builder(root.name()).with_fields(fields).build().map_err(|e| e.to_string())
    }

    /// Calls `f(o, row number, row)` for each row with `columns` decoded; a row that cannot be read is a bad record
    /// that ends the file (not reported again from row `seen` on: an earlier pass stopped there, and said why).
    pub fn rows(
        &self,
        columns: &[&str],
        seen: Option<usize>,
        o: &mut Output,
        mut f: impl FnMut(&mut Output, usize, Row) -> Result<(), ConvertError>,
    ) -> Result<(), ConvertError> {
        let proj = match self.projection(columns) {
            Ok(p) => p,
            Err(e) => return o.bad(&format!("mind2web {}", self.path.display()), &e, "file skipped"),
        };
        let mut n = 0;
        for g in 0..self.reader.num_row_groups() {
            let at = |n| format!("mind2web {} (row group {g})", self.at(n));
            let bad = |o: &mut Output, n: usize, why: String| match seen {
                Some(seen) if n >= seen => Ok(()),
                _ => o.bad(&at(n), &why, "the rest of the file skipped"),
            };
            let group = self.reader.get_row_group(g);
            let rows = group
                .as_ref()
                .map_err(|e| e.to_string())
                .and_then(|rg| guarded(|| RowIter::from_row_group(Some(proj.clone()), &**rg)));
            let mut rows = match rows {
                Ok(rows) => rows,
                Err(e) => return bad(o, n, format!("unreadable row group ({e})")),
            };
            while let Some(row) = guarded(|| rows.next().transpose()).transpose() {
                match row {
                    Ok(row) => f(o, n, row)?,
                    Err(e) => return bad(o, n, format!("unreadable row ({e})")),
                }
                n += 1;
            }
        }
        Ok(())
    }
}

/// `read()`, with a panic of the parquet crate (its answer to some corrupt pages) as an error. Unwind safety: after
/// an error the reader is dropped, the file left (the caller returns), so no state a panic broke is seen again.
fn guarded<T>(read: impl FnOnce() -> parquet::errors::Result<T>) -> Result<T, String> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)) {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(panic) => {
            let msg =
                panic.downcast_ref::<&str>().map(|s| s.to_string()).or_else(|| panic.downcast_ref::<String>().cloned());
            Err(format!("corrupt data: the parquet reader failed ({})", msg.unwrap_or_default()))
        }
    }
}

/// A row's columns as the JSON object the JSONL reader sees (the screenshot left out: [`screenshot`]).
pub(super) fn row_json(row: &Row) -> Result<Value, String> {
    let mut obj = serde_json::Map::new();
    for (name, field) in row.get_column_iter().filter(|(name, _)| name.as_str() != SCREENSHOT) {
        obj.insert(name.clone(), field_json(field).map_err(|e| format!("column `{name}`: {e}"))?);
    }
    Ok(Value::Object(obj))
}

fn field_json(field: &Field) -> Result<Value, String> {
    Ok(match field {
        Field::Null => Value::Null,
        Field::Bool(b) => Value::Bool(*b),
        Field::Str(s) => Value::String(s.clone()),
        Field::Bytes(b) => match std::str::from_utf8(b.data()) {
            Ok(s) => Value::String(s.to_string()),
            Err(_) => return Err("binary, not UTF-8 text".into()),
        },
        Field::ListInternal(list) => Value::Array(list.elements().iter().map(field_json).collect::<Result<_, _>>()?),
        Field::Group(row) => row_json(row)?,
        Field::Float(x) => serde_json::json!(x),
        Field::Double(x) => serde_json::json!(x),
        // The integers (any width), dates and the rest: their display form is JSON for the integers.
        other => serde_json::from_str(&other.to_string()).unwrap_or_else(|_| Value::String(other.to_string())),
    })
}

/// The screenshot's image bytes: the image feature's `bytes` (a plain binary column is accepted too).
pub(super) fn screenshot(row: &Row) -> Result<Vec<u8>, String> {
    let field = row.get_column_iter().find(|(name, _)| name.as_str() == SCREENSHOT).map(|(_, f)| f);
    match field {
        None | Some(Field::Null) => Err(format!("`{SCREENSHOT}` is null")),
        Some(Field::Bytes(b)) => Ok(b.data().to_vec()),
        Some(Field::Group(g)) => {
            let part = |key: &str| g.get_column_iter().find(|(name, _)| name.as_str() == key).map(|(_, f)| f);
            match (part("bytes"), part("path")) {
                (Some(Field::Bytes(b)), _) => Ok(b.data().to_vec()),
                (_, Some(Field::Str(p))) => {
                    Err(format!("`{SCREENSHOT}` has no `bytes`, only the path {p:?} (images not embedded)"))
                }
                _ => Err(format!("`{SCREENSHOT}` has no `bytes`")),
            }
        }
        Some(other) => Err(format!("`{SCREENSHOT}` is {}, not an image {{bytes, path}}", snippet(&other.to_string()))),
    }
}
