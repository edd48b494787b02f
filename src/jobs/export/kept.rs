//! The columns a publish kept with each record (`--keep-columns`), appended to a results
//! export: in Parquet each as a column of the type it had in the input (`int64`, `float64`,
//! `bool`, `string`; lists and structs as JSON text), in JSON lines as keys of the row. A kept
//! column whose name is one of the export's own takes the prefix `input_`.

use super::table::Table;
use crate::jobs::input::columns::Kept;
use arrow_array::builder::{
    BooleanBuilder, Float64Builder, Int64Builder, StringBuilder, UInt64Builder,
};
use arrow_array::{ArrayRef, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef};
use serde_json::Value;
use std::sync::Arc;

/// A job's kept columns, named as the export writes them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeptColumns {
    /// The columns as the job's publishes kept them.
    columns: Vec<Kept>,
    /// Their names in the export.
    names: Vec<String>,
}

impl KeptColumns {
    /// `columns` (the job's `columns`, a JSON array; none or unreadable: no columns) for rows
    /// of `T`.
    pub fn new<T: Table>(columns: Option<&str>) -> Self {
        let columns: Vec<Kept> = columns
            .and_then(|c| serde_json::from_str(c).ok())
            .unwrap_or_default();
        let own = T::schema();
        let names = columns
            .iter()
            .map(|k| match own.field_with_name(&k.name) {
                Ok(_) => format!("input_{}", k.name),
                Err(_) => k.name.clone(),
            })
            .collect();
        Self { columns, names }
    }

    /// `T`'s schema with the kept columns after its own.
    pub fn schema<T: Table>(&self) -> SchemaRef {
        let own = T::schema();
        let mut fields: Vec<Field> = own.fields().iter().map(|f| f.as_ref().clone()).collect();
        for (k, name) in self.columns.iter().zip(&self.names) {
            fields.push(Field::new(name, arrow_type(&k.kind), true));
        }
        Arc::new(Schema::new(fields))
    }

    /// `rows` as one batch of [`KeptColumns::schema`].
    pub fn batch<T: Table>(&self, rows: &[T]) -> Result<RecordBatch, ArrowError> {
        let own = T::batch(rows)?;
        if self.columns.is_empty() {
            return Ok(own);
        }
        let kept: Vec<serde_json::Map<String, Value>> = rows
            .iter()
            .map(|r| {
                r.kept()
                    .and_then(|k| serde_json::from_str(k).ok())
                    .unwrap_or_default()
            })
            .collect();
        let mut columns = own.columns().to_vec();
        for k in &self.columns {
            columns.push(array(&k.kind, kept.iter().map(|m| m.get(&k.name))));
        }
        RecordBatch::try_new(self.schema::<T>(), columns)
    }

    /// `row`'s JSON line with its kept columns.
    pub fn json<T: Table>(&self, row: &T) -> Value {
        let mut line = row.json();
        if self.columns.is_empty() {
            return line;
        }
        let kept: serde_json::Map<String, Value> = row
            .kept()
            .and_then(|k| serde_json::from_str(k).ok())
            .unwrap_or_default();
        if let Value::Object(line) = &mut line {
            for (k, name) in self.columns.iter().zip(&self.names) {
                line.insert(
                    name.clone(),
                    kept.get(&k.name).cloned().unwrap_or(Value::Null),
                );
            }
        }
        line
    }
}

/// The Arrow type of a kept column's export type.
fn arrow_type(kind: &str) -> DataType {
    match kind {
        "int64" => DataType::Int64,
        "uint64" => DataType::UInt64,
        "float64" => DataType::Float64,
        "bool" => DataType::Boolean,
        _ => DataType::Utf8,
    }
}

/// One kept column's values as an array of its type (a value of another type is null, except
/// in a string column, which takes any value as its JSON text).
fn array<'a>(kind: &str, values: impl Iterator<Item = Option<&'a Value>>) -> ArrayRef {
    match kind {
        "int64" => {
            let mut b = Int64Builder::new();
            values.for_each(|v| b.append_option(v.and_then(Value::as_i64)));
            Arc::new(b.finish())
        }
        "uint64" => {
            let mut b = UInt64Builder::new();
            values.for_each(|v| b.append_option(v.and_then(Value::as_u64)));
            Arc::new(b.finish())
        }
        "float64" => {
            let mut b = Float64Builder::new();
            values.for_each(|v| b.append_option(v.and_then(Value::as_f64)));
            Arc::new(b.finish())
        }
        "bool" => {
            let mut b = BooleanBuilder::new();
            values.for_each(|v| b.append_option(v.and_then(Value::as_bool)));
            Arc::new(b.finish())
        }
        _ => {
            let mut b = StringBuilder::new();
            for v in values {
                match v {
                    None | Some(Value::Null) => b.append_null(),
                    Some(Value::String(s)) => b.append_value(s),
                    Some(other) => b.append_value(other.to_string()),
                }
            }
            Arc::new(b.finish())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{array, arrow_type};
    use arrow_array::cast::AsArray;
    use arrow_array::Array;
    use arrow_schema::DataType;
    use serde_json::Value;

    /// A kept UInt64 column exports as UInt64, its values past `i64::MAX` exact.
    #[test]
    fn unsigned_64_bit_columns_export_exactly() {
        assert_eq!(arrow_type("uint64"), DataType::UInt64);
        let values = [Value::from(u64::MAX), Value::Null, Value::from(3u64)];
        let a = array("uint64", values.iter().map(Some));
        let a = a.as_primitive::<arrow_array::types::UInt64Type>();
        assert_eq!(a.value(0), u64::MAX);
        assert!(a.is_null(1));
        assert_eq!(a.value(2), 3);
    }

    /// A kept float64 read back from the job's JSON is the value written, bit for bit: the
    /// BigQuery export's `-521781.49063498003` came back one unit in the last place off before
    /// serde_json parsed floats exactly (its `float_roundtrip` feature).
    #[test]
    fn kept_floats_read_back_exactly() {
        let written = [
            -521781.49063498003f64,
            0.1,
            1e-300,
            123456789.12345679,
            -0.0,
        ];
        for x in written {
            let json = serde_json::json!({ "score": x }).to_string();
            let back: Value = serde_json::from_str(&json).unwrap();
            let got = back["score"].as_f64().unwrap();
            assert_eq!(
                got.to_bits(),
                x.to_bits(),
                "{x} written as {json}, read as {got}"
            );
        }
        for text in [
            "-521781.49063498003",
            "2.2250738585072011e-308",
            "9007199254740993.0",
        ] {
            let back: Value = serde_json::from_str(text).unwrap();
            let want: f64 = text.parse().unwrap();
            assert_eq!(back.as_f64().unwrap().to_bits(), want.to_bits(), "{text}");
        }
    }
}
