//! Which columns of a table make a record: the id (or one generated from the shard and row),
//! the text (and its pair), the image, the chat messages or the prompt, and the columns kept
//! with the record for the user to join the results back to the source table by.
//!
//! A mapping is first [`Columns::plan`]ned against a shard's columns, so a missing or mistyped
//! column stops the publish before anything goes out, naming it; each row is then made into the
//! message contract's JSON ([`Plan::record`]), or refused with the column and the reason.

use serde_json::{Map, Value};

/// The mapping the user gave (`--id-column`, `--text-column`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Columns {
    /// The id's column; `None`: ids made of the shard's name and the row number.
    pub id: Option<String>,
    /// What the model reads.
    pub payload: Payload,
    /// Columns kept with each record, into its job and the job's exports.
    pub keep: Vec<String>,
}

/// The column(s) a record's input comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    /// The first of `text`, `messages`, `prompt`, `uri` and `image_base64` the shard has (with
    /// `text_pair` beside a `text`): the message contract's own keys.
    Auto,
    /// A text, and maybe the second text of a pair.
    Text {
        /// The text's column.
        column: String,
        /// The pair's column.
        pair: Option<String>,
    },
    /// A picture: a `gs://` URI (a text column) or the encoded file (a binary column).
    Image(String),
    /// A chat: a list of `{role, content}`, or a text column holding it as JSON.
    Messages(String),
    /// A raw completion prompt.
    Prompt(String),
}

/// A column's type, as far as a record cares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    /// Strings (any Arrow string or dictionary of strings; every CSV column).
    Text,
    /// Signed integers (and unsigned ones below 64 bits), read as 64-bit.
    Int,
    /// Unsigned 64-bit integers (all of them past `i64::MAX` too), kept and exported as such.
    UInt,
    /// Floating point.
    Float,
    /// Booleans.
    Bool,
    /// Bytes.
    Bytes,
    /// A list (of structs, for chat messages).
    List,
    /// Not known before a row is read (JSON lines).
    Any,
    /// Anything else, by its type's name (kept columns take it as text).
    Other(String),
}

impl std::fmt::Display for Kind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Kind::Text => "strings",
            Kind::Int => "integers",
            Kind::UInt => "unsigned integers",
            Kind::Float => "floats",
            Kind::Bool => "booleans",
            Kind::Bytes => "bytes",
            Kind::List => "lists",
            Kind::Any => "values",
            Kind::Other(t) => t,
        })
    }
}

impl Kind {
    /// How a kept column of this kind is typed in the job's exports.
    pub fn export_type(&self) -> &'static str {
        match self {
            Kind::Int => "int64",
            Kind::UInt => "uint64",
            Kind::Float => "float64",
            Kind::Bool => "bool",
            Kind::Any | Kind::List => "json",
            Kind::Text | Kind::Bytes | Kind::Other(_) => "string",
        }
    }
}

/// One value of a row.
#[derive(Debug, Clone, PartialEq)]
pub enum Cell {
    /// Null, or absent.
    Null,
    /// A string.
    Text(String),
    /// An integer.
    Int(i64),
    /// A float.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// Bytes.
    Bytes(Vec<u8>),
    /// A JSON value (a JSON line's field, a list read as JSON).
    Json(Value),
}

/// A kept column: its name and its type in exports.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Kept {
    /// The column's name.
    pub name: String,
    /// `string`, `int64`, `float64`, `bool` or `json`.
    #[serde(rename = "type")]
    pub kind: String,
}

/// A mapping checked against a shard's columns: the columns to read, in order, and what each
/// becomes.
#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    /// Every column a row is read for, in the order [`Plan::record`] takes their cells.
    pub read: Vec<String>,
    id: bool,
    key: &'static str,
    pair: bool,
    /// The kept columns and their export types.
    pub keep: Vec<Kept>,
}

impl Columns {
    /// The mapping checked against `schema` (each column's name and kind): the plan, or why it
    /// does not fit (the missing or mistyped column, and the columns there are).
    pub fn plan(&self, schema: &[(String, Kind)]) -> Result<Plan, String> {
        let kind_of = |name: &str| schema.iter().find(|(n, _)| n == name).map(|(_, k)| k);
        let missing = |name: &str, role: &str| {
            let names: Vec<&str> = schema.iter().map(|(n, _)| n.as_str()).collect();
            format!(
                "no column {name:?} (the {role}); its columns: {}",
                names.join(", ")
            )
        };
        let need = |name: &str, role: &str, ok: &[Kind]| -> Result<(), String> {
            let kind = kind_of(name).ok_or_else(|| missing(name, role))?;
            if *kind == Kind::Any || ok.contains(kind) {
                return Ok(());
            }
            let ok: Vec<String> = ok.iter().map(Kind::to_string).collect();
            Err(format!(
                "column {name:?} (the {role}) holds {kind}; it must hold {}",
                ok.join(" or ")
            ))
        };
        let mut read = Vec::new();
        if let Some(id) = &self.id {
            need(id, "record id", &[Kind::Text, Kind::Int, Kind::UInt])?;
            read.push(id.clone());
        }
        let (key, column, pair) = self.input(&kind_of)?;
        let role = format!("record's {key}");
        match key {
            "uri" | "image_base64" => need(&column, &role, &[Kind::Text, Kind::Bytes])?,
            "messages" => need(&column, &role, &[Kind::List, Kind::Text])?,
            _ => need(&column, &role, &[Kind::Text])?,
        }
        read.push(column);
        if let Some(pair) = &pair {
            need(pair, "text pair", &[Kind::Text])?;
            read.push(pair.clone());
        }
        let mut keep = Vec::new();
        for name in &self.keep {
            let kind = kind_of(name).ok_or_else(|| missing(name, "kept column"))?;
            keep.push(Kept {
                name: name.clone(),
                kind: kind.export_type().to_string(),
            });
            read.push(name.clone());
        }
        Ok(Plan {
            read,
            id: self.id.is_some(),
            key,
            pair: pair.is_some(),
            keep,
        })
    }

    /// The record key the payload fills, its column and the pair's column.
    fn input<'k>(
        &self,
        kind_of: &impl Fn(&str) -> Option<&'k Kind>,
    ) -> Result<(&'static str, String, Option<String>), String> {
        Ok(match &self.payload {
            Payload::Text { column, pair } => ("text", column.clone(), pair.clone()),
            Payload::Image(c) => ("uri", c.clone(), None),
            Payload::Messages(c) => ("messages", c.clone(), None),
            Payload::Prompt(c) => ("prompt", c.clone(), None),
            Payload::Auto => {
                let keys = ["text", "messages", "prompt", "uri", "image_base64"];
                let key = keys.into_iter().find(|k| kind_of(k).is_some()).ok_or(
                    "none of the columns text, messages, prompt, uri or image_base64: name the \
                     input's column (--text-column, --image-column, --messages-column or \
                     --prompt-column)",
                )?;
                let pair = (key == "text" && kind_of("text_pair").is_some())
                    .then(|| "text_pair".to_string());
                (key, key.to_string(), pair)
            }
        })
    }
}

impl Plan {
    /// The columns a row cannot do without: the id's (unless generated) and the input's.
    pub fn required(&self) -> &[String] {
        &self.read[..1 + usize::from(self.id)]
    }

    /// The id a row refused before its cells were mapped names: read from its id column's cell
    /// (`None` when absent or unreadable), or the one it would have been given.
    pub fn known_id(&self, id_cell: Option<Cell>, shard: &str, row: u64) -> Option<String> {
        self.id_of(id_cell.unwrap_or(Cell::Null), shard, row).ok()
    }

    /// The record id: the id column's cell (a string or an integer), or one made from `shard`
    /// and `row` when the plan has no id column; or why the cell is no id.
    fn id_of(&self, id_cell: Cell, shard: &str, row: u64) -> Result<String, String> {
        match self.id {
            true => id_value((id_cell, &self.read[0])),
            false => Ok(format!("{shard}:{row}")),
        }
    }

    /// The record's message JSON and its kept columns (a JSON object, `None` when none are
    /// kept), from the row's cells in [`Plan::read`] order; or why the row is refused, with its
    /// id when that much could be read (`export --failed` names the record). `shard`
    /// (the shard's full location: an absolute path or a `gs://` URI) and `row` make a
    /// generated id, so two exports whose shards share a name never share an id.
    pub fn record(
        &self,
        cells: Vec<Cell>,
        shard: &str,
        row: u64,
    ) -> Result<(String, Option<String>), Refusal> {
        let mut cells = cells.into_iter().zip(&self.read);
        let mut next = || cells.next().unwrap_or((Cell::Null, &self.read[0]));
        let mut record = Map::new();
        let id_cell = if self.id { next().0 } else { Cell::Null };
        let id = self
            .id_of(id_cell, shard, row)
            .map_err(|error| Refusal { error, id: None })?;
        let refused = |error| Refusal {
            error,
            id: Some(id.clone()),
        };
        let (cell, column) = next();
        let (key, value) = input_value(self.key, cell, column).map_err(refused)?;
        record.insert("id".into(), Value::String(id));
        record.insert(key.into(), value);
        if self.pair {
            if let (Cell::Text(pair), _) | (Cell::Json(Value::String(pair)), _) = next() {
                record.insert("text_pair".into(), Value::String(pair));
            }
        }
        let mut kept = Map::new();
        for _ in &self.keep {
            let (cell, column) = next();
            kept.insert(column.clone(), cell.into_json());
        }
        let kept = (!self.keep.is_empty()).then(|| Value::Object(kept).to_string());
        Ok((Value::Object(record).to_string(), kept))
    }
}

/// Why a row is refused, and the id it was to have where that much was read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// Why, in the user's words (which column, what it holds).
    pub error: String,
    /// The record's id, read (or generated) before the refusal.
    pub id: Option<String>,
}

/// A record id from its cell: a string or an integer.
fn id_value((cell, column): (Cell, &String)) -> Result<String, String> {
    match cell {
        Cell::Text(s) | Cell::Json(Value::String(s)) if !s.is_empty() => Ok(s),
        Cell::Int(i) => Ok(i.to_string()),
        Cell::Json(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(n.to_string()),
        Cell::Null | Cell::Json(Value::Null) => Err(format!("column {column:?} (the id) is null")),
        Cell::Text(_) | Cell::Json(Value::String(_)) => {
            Err(format!("column {column:?} (the id) is empty"))
        }
        other => Err(format!(
            "column {column:?} (the id) holds {}, not a string or an integer",
            what(&other)
        )),
    }
}

/// The record key and value of the input's cell.
fn input_value(
    key: &'static str,
    cell: Cell,
    column: &str,
) -> Result<(&'static str, Value), String> {
    let wrong = |cell: &Cell| {
        format!(
            "column {column:?} (the record's {key}) holds {}",
            what(cell)
        )
    };
    match (key, cell) {
        (_, Cell::Null | Cell::Json(Value::Null)) => {
            Err(format!("column {column:?} (the record's {key}) is null"))
        }
        (_, Cell::Text(s) | Cell::Json(Value::String(s))) if s.is_empty() => {
            Err(format!("column {column:?} (the record's {key}) is empty"))
        }
        ("uri" | "image_base64", Cell::Bytes(b)) => {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(b);
            Ok(("image_base64", Value::String(b64)))
        }
        ("messages", Cell::Text(s)) => serde_json::from_str(&s)
            .map(|v| ("messages", v))
            .map_err(|e| format!("column {column:?} (the chat messages) is not JSON: {e}")),
        ("messages", Cell::Json(v @ Value::Array(_))) => Ok(("messages", v)),
        (_, Cell::Text(s)) | (_, Cell::Json(Value::String(s))) if key != "messages" => {
            Ok((key, Value::String(s)))
        }
        (_, cell) => Err(wrong(&cell)),
    }
}

impl Cell {
    /// The cell as JSON: a kept column's value, or a refused table row's copy. Bytes become
    /// base64; a float JSON cannot hold (NaN, infinities) becomes null.
    pub fn into_json(self) -> Value {
        match self {
            Cell::Null => Value::Null,
            Cell::Text(s) => Value::String(s),
            Cell::Int(i) => Value::from(i),
            Cell::Float(f) => serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number),
            Cell::Bool(b) => Value::Bool(b),
            Cell::Bytes(b) => {
                use base64::Engine;
                Value::String(base64::engine::general_purpose::STANDARD.encode(b))
            }
            Cell::Json(v) => v,
        }
    }
}

/// What a cell holds, for an error.
fn what(cell: &Cell) -> &'static str {
    match cell {
        Cell::Null | Cell::Json(Value::Null) => "null",
        Cell::Text(_) | Cell::Json(Value::String(_)) => "a string",
        Cell::Int(_) | Cell::Float(_) | Cell::Json(Value::Number(_)) => "a number",
        Cell::Bool(_) | Cell::Json(Value::Bool(_)) => "a boolean",
        Cell::Bytes(_) => "bytes",
        Cell::Json(Value::Array(_)) => "a list",
        Cell::Json(Value::Object(_)) => "an object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema(cols: &[(&str, Kind)]) -> Vec<(String, Kind)> {
        cols.iter()
            .map(|(n, k)| (n.to_string(), k.clone()))
            .collect()
    }

    fn record(plan: &Plan, cells: Vec<Cell>) -> Value {
        let (json, _) = plan.record(cells, "part-1.parquet", 7).expect("a record");
        serde_json::from_str(&json).unwrap()
    }

    /// Each kind of input column makes the message contract's key: a text and its pair, an
    /// image as a URI or as bytes, a chat as a list or as JSON text, a raw prompt; generated
    /// ids name the shard and row.
    #[test]
    fn every_input_column_makes_its_record_key() {
        let text = Columns {
            id: None,
            payload: Payload::Text {
                column: "body".into(),
                pair: Some("other".into()),
            },
            keep: vec![],
        };
        let plan = text
            .plan(&schema(&[("body", Kind::Text), ("other", Kind::Text)]))
            .unwrap();
        let r = record(&plan, vec![Cell::Text("q".into()), Cell::Text("p".into())]);
        assert_eq!(
            r,
            serde_json::json!({"id": "part-1.parquet:7", "text": "q", "text_pair": "p"})
        );

        let image = Columns {
            id: Some("k".into()),
            payload: Payload::Image("img".into()),
            keep: vec![],
        };
        let plan = image
            .plan(&schema(&[("k", Kind::Int), ("img", Kind::Bytes)]))
            .unwrap();
        let r = record(&plan, vec![Cell::Int(3), Cell::Bytes(vec![0xff, 0xd8])]);
        assert_eq!(r, serde_json::json!({"id": "3", "image_base64": "/9g="}));
        let r = record(&plan, vec![Cell::Int(3), Cell::Text("gs://b/a.jpg".into())]);
        assert_eq!(r["uri"], "gs://b/a.jpg");

        let chat = Columns {
            id: Some("k".into()),
            payload: Payload::Messages("m".into()),
            keep: vec!["lang".into()],
        };
        let plan = chat
            .plan(&schema(&[
                ("k", Kind::Text),
                ("m", Kind::List),
                ("lang", Kind::Other("date32".into())),
            ]))
            .unwrap();
        let messages = serde_json::json!([{"role": "user", "content": "hi"}]);
        let cells = vec![
            Cell::Text("c1".into()),
            Cell::Json(messages.clone()),
            Cell::Text("2026-11-27".into()),
        ];
        let (json, kept) = plan.record(cells, "s", 1).unwrap();
        let r: Value = serde_json::from_str(&json).unwrap();
        assert_eq!(r["messages"], messages);
        assert_eq!(kept.as_deref(), Some(r#"{"lang":"2026-11-27"}"#));
        assert_eq!(plan.keep[0].kind, "string");
        let as_text = vec![
            Cell::Text("c2".into()),
            Cell::Text(messages.to_string()),
            Cell::Null,
        ];
        assert_eq!(record(&plan, as_text)["messages"], messages);
        let bad = vec![
            Cell::Text("c3".into()),
            Cell::Text("not json".into()),
            Cell::Null,
        ];
        let err = plan.record(bad, "s", 2).unwrap_err();
        assert!(
            err.error
                .contains("column \"m\" (the chat messages) is not JSON"),
            "{err:?}"
        );
        // The id was read before the refusal: export --failed names the record.
        assert_eq!(err.id.as_deref(), Some("c3"));

        let prompt = Columns {
            id: Some("k".into()),
            payload: Payload::Prompt("p".into()),
            keep: vec![],
        };
        let plan = prompt
            .plan(&schema(&[("k", Kind::Text), ("p", Kind::Text)]))
            .unwrap();
        let r = record(
            &plan,
            vec![Cell::Text("a".into()), Cell::Text("Once".into())],
        );
        assert_eq!(r["prompt"], "Once");
    }

    /// Without flags, a table's columns are the contract's keys: the first input key it has.
    #[test]
    fn the_contract_s_own_names_are_found_in_a_table() {
        let auto = Columns {
            id: Some("id".into()),
            payload: Payload::Auto,
            keep: vec![],
        };
        let plan = auto
            .plan(&schema(&[
                ("id", Kind::Text),
                ("image_base64", Kind::Bytes),
            ]))
            .unwrap();
        let r = record(&plan, vec![Cell::Text("x".into()), Cell::Bytes(vec![1])]);
        assert_eq!(r["image_base64"], "AQ==");
        let err = auto
            .plan(&schema(&[("id", Kind::Text), ("body", Kind::Text)]))
            .unwrap_err();
        assert!(err.contains("--text-column"), "{err}");
        let err = auto
            .plan(&schema(&[("id", Kind::Float), ("text", Kind::Text)]))
            .unwrap_err();
        assert!(
            err.contains("holds floats; it must hold strings or integers"),
            "{err}"
        );
    }
}
