//! Parquet, row group by row group, only the columns a mapping reads; each Arrow cell read as
//! what it is (every integer type, strings plain or dictionary-encoded, lists and structs as
//! JSON).

use super::{planned, RowKind, Sender, BATCH_BYTES};
use crate::jobs::input::columns::{Cell, Columns, Kind};
use crate::jobs::input::{InputError, Shard};
use arrow_array::{Array, ArrayRef};

/// A Parquet file, row group by row group, reading only the plan's columns.
pub(super) fn rows(
    shard: &Shard,
    file: std::fs::File,
    columns: &Columns,
    out: &mut Sender,
) -> Result<(), InputError> {
    use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;
    use parquet::arrow::ProjectionMask;
    let unreadable = |reason: String| InputError::Unreadable {
        shard: shard.name.clone(),
        reason,
    };
    let builder =
        ParquetRecordBatchReaderBuilder::try_new(file).map_err(|e| unreadable(e.to_string()))?;
    let arrow = builder.schema().clone();
    let schema: Vec<(String, Kind)> = arrow
        .fields()
        .iter()
        .map(|f| (f.name().clone(), kind(f.data_type())))
        .collect();
    let plan = planned(shard, columns, &schema, out)?;
    let roots = plan
        .read
        .iter()
        .filter_map(|c| arrow.fields().iter().position(|f| f.name() == c));
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    let total = builder.metadata().file_metadata().num_rows().max(1) as u64;
    let batch = batch_rows(builder.metadata(), total);
    let reader = builder
        .with_projection(mask)
        .with_batch_size(batch)
        .build()
        .map_err(|e| unreadable(e.to_string()))?;
    let mut number = 0u64;
    for batch in reader {
        let batch = batch.map_err(|e| unreadable(e.to_string()))?;
        let arrays: Vec<Column> = plan
            .read
            .iter()
            .filter_map(|c| batch.column_by_name(c).map(Column::new))
            .collect();
        out.progress += shard.size * batch.num_rows() as u64 / total;
        for i in 0..batch.num_rows() {
            number += 1;
            let cells = arrays.iter().map(|a| a.cell(i)).collect();
            let kind = match plan.record(cells, &shard.name, number) {
                Ok((record, kept)) => RowKind::Mapped { record, kept },
                Err(r) => RowKind::Refused {
                    raw: row_json(&plan.read, &arrays, i).into_bytes(),
                    error: r.error,
                    id: r.id,
                },
            };
            if !out.push(number, kind) {
                return Ok(());
            }
        }
    }
    Ok(())
}

/// Rows decoded at once: 1,024, or fewer where the rows are large, so one decoded batch holds
/// about [`BATCH_BYTES`] whatever the rows' sizes (the file's uncompressed bytes over its rows:
/// every column's, an upper bound for the columns read).
fn batch_rows(meta: &parquet::file::metadata::ParquetMetaData, rows: u64) -> usize {
    let bytes: i64 = meta.row_groups().iter().map(|g| g.total_byte_size()).sum();
    let per_row = (bytes.max(0) as u64 / rows).max(1);
    (BATCH_BYTES as u64 / per_row).clamp(1, 1024) as usize
}

/// What a record makes of an Arrow type.
fn kind(t: &arrow_schema::DataType) -> Kind {
    use arrow_schema::DataType as T;
    match t {
        T::Utf8 | T::LargeUtf8 | T::Utf8View => Kind::Text,
        T::Dictionary(_, values) => kind(values),
        T::Int8 | T::Int16 | T::Int32 | T::Int64 | T::UInt8 | T::UInt16 | T::UInt32 => Kind::Int,
        T::UInt64 => Kind::UInt,
        T::Float16 | T::Float32 | T::Float64 => Kind::Float,
        T::Boolean => Kind::Bool,
        T::Binary | T::LargeBinary | T::BinaryView | T::FixedSizeBinary(_) => Kind::Bytes,
        T::List(_)
        | T::LargeList(_)
        | T::ListView(_)
        | T::LargeListView(_)
        | T::FixedSizeList(..) => Kind::List,
        other => Kind::Other(other.to_string()),
    }
}

/// A batch's column, cast once to what its cells are read from.
enum Column {
    /// Strings of any encoding (plain, large, view, dictionary), as plain strings.
    Text(arrow_array::StringArray),
    /// Integers, as 64-bit.
    Int(arrow_array::Int64Array),
    /// Unsigned 64-bit integers, as they are (a cast to i64 would fail past `i64::MAX`).
    UInt(arrow_array::UInt64Array),
    /// Bytes of any encoding, as plain binary.
    Bytes(arrow_array::BinaryArray),
    /// Anything else, read value by value.
    Other(ArrayRef),
}

impl Column {
    /// `a` cast for reading (a cast that fails, such as a string column over 2 GiB in one
    /// batch, leaves it to be read value by value).
    fn new(a: &ArrayRef) -> Self {
        use arrow_array::cast::AsArray;
        use arrow_schema::DataType as T;
        let cast = |t: &T| arrow_cast::cast(a, t).ok();
        let column = match kind(a.data_type()) {
            Kind::Text => cast(&T::Utf8).map(|c| Column::Text(c.as_string::<i32>().clone())),
            Kind::Int => cast(&T::Int64)
                .map(|c| Column::Int(c.as_primitive::<arrow_array::types::Int64Type>().clone())),
            Kind::UInt => cast(&T::UInt64)
                .map(|c| Column::UInt(c.as_primitive::<arrow_array::types::UInt64Type>().clone())),
            Kind::Bytes => cast(&T::Binary).map(|c| Column::Bytes(c.as_binary::<i32>().clone())),
            _ => None,
        };
        column.unwrap_or_else(|| Column::Other(a.clone()))
    }

    /// Row `i` as a cell.
    fn cell(&self, i: usize) -> Cell {
        match self {
            Column::Text(a) if a.is_valid(i) => Cell::Text(a.value(i).to_string()),
            Column::Int(a) if a.is_valid(i) => Cell::Int(a.value(i)),
            Column::UInt(a) if a.is_valid(i) => Cell::Json(a.value(i).into()),
            Column::Bytes(a) if a.is_valid(i) => Cell::Bytes(a.value(i).to_vec()),
            Column::Other(a) if a.is_valid(i) => match to_json(a, i) {
                serde_json::Value::Number(n) if n.is_i64() => Cell::Int(n.as_i64().unwrap_or(0)),
                serde_json::Value::Number(n) => Cell::Float(n.as_f64().unwrap_or(f64::NAN)),
                serde_json::Value::Bool(b) => Cell::Bool(b),
                serde_json::Value::String(s) => Cell::Text(s),
                v => Cell::Json(v),
            },
            _ => Cell::Null,
        }
    }

    /// Row `i` as JSON (a refused row's copy).
    fn json(&self, i: usize) -> serde_json::Value {
        self.cell(i).into_json()
    }
}

/// Row `i` of a string-like array (plain, large, view or dictionary-encoded).
fn text(a: &ArrayRef, i: usize) -> Option<String> {
    let one = a.slice(i, 1);
    let strings = arrow_cast::cast(&one, &arrow_schema::DataType::Utf8).ok()?;
    let strings = strings
        .as_any()
        .downcast_ref::<arrow_array::StringArray>()?;
    (!strings.is_null(0)).then(|| strings.value(0).to_string())
}

/// Row `i` of a binary-like array.
fn bytes(a: &ArrayRef, i: usize) -> Option<Vec<u8>> {
    let one = a.slice(i, 1);
    let b = arrow_cast::cast(&one, &arrow_schema::DataType::Binary).ok()?;
    let b = b.as_any().downcast_ref::<arrow_array::BinaryArray>()?;
    (!b.is_null(0)).then(|| b.value(0).to_vec())
}

/// Row `i` as Arrow displays it (dates, decimals, timestamps...).
fn display(a: &ArrayRef, i: usize) -> Option<String> {
    let options = arrow_cast::display::FormatOptions::default();
    let f = arrow_cast::display::ArrayFormatter::try_new(a.as_ref(), &options).ok()?;
    Some(f.value(i).to_string())
}

/// Row `i` as JSON: numbers, booleans, strings, lists and structs as themselves, bytes as
/// base64, anything else as Arrow displays it.
fn to_json(a: &ArrayRef, i: usize) -> serde_json::Value {
    use arrow_array::cast::AsArray;
    use arrow_schema::DataType as T;
    use serde_json::Value;
    if a.is_null(i) {
        return Value::Null;
    }
    let as_i64 = || {
        arrow_cast::cast(&a.slice(i, 1), &T::Int64)
            .ok()
            .and_then(|x| {
                x.as_primitive_opt::<arrow_array::types::Int64Type>()
                    .map(|p| p.value(0))
            })
    };
    match a.data_type() {
        T::Boolean => Value::Bool(a.as_boolean().value(i)),
        T::Int8 | T::Int16 | T::Int32 | T::Int64 | T::UInt8 | T::UInt16 | T::UInt32 => {
            as_i64().map_or(Value::Null, Value::from)
        }
        T::UInt64 => Value::from(a.as_primitive::<arrow_array::types::UInt64Type>().value(i)),
        T::Float16 | T::Float32 | T::Float64 => arrow_cast::cast(&a.slice(i, 1), &T::Float64)
            .ok()
            .and_then(|x| {
                x.as_primitive_opt::<arrow_array::types::Float64Type>()
                    .map(|p| p.value(0))
            })
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::Null, Value::Number),
        T::List(_) => list(a.as_list::<i32>().value(i)),
        T::LargeList(_) => list(a.as_list::<i64>().value(i)),
        T::FixedSizeList(..) => list(a.as_fixed_size_list().value(i)),
        T::Struct(fields) => {
            let s = a.as_struct();
            let object = fields
                .iter()
                .zip(s.columns())
                .map(|(f, c)| (f.name().clone(), to_json(c, i)))
                .collect();
            Value::Object(object)
        }
        _ => match kind(a.data_type()) {
            Kind::Text => text(a, i).map_or(Value::Null, Value::String),
            Kind::Bytes => bytes(a, i).map_or(Value::Null, |b| {
                use base64::Engine;
                Value::String(base64::engine::general_purpose::STANDARD.encode(b))
            }),
            _ => display(a, i).map_or(Value::Null, Value::String),
        },
    }
}

/// A list's values as a JSON array.
fn list(values: ArrayRef) -> serde_json::Value {
    serde_json::Value::Array((0..values.len()).map(|j| to_json(&values, j)).collect())
}

/// A table row's read columns as a JSON object (what a refusal keeps of it).
fn row_json(names: &[String], columns: &[Column], i: usize) -> String {
    let object = names
        .iter()
        .zip(columns)
        .map(|(n, c)| (n.clone(), c.json(i)))
        .collect();
    serde_json::Value::Object(object).to_string()
}
