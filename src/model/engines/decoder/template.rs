//! Chat templates: a model's Jinja template rendered with `minijinja` as transformers'
//! `apply_chat_template(messages, add_generation_prompt=True)` renders it with jinja2: blocks
//! trimmed (`trim_blocks`, `lstrip_blocks`), Python's string and dict methods (`.strip()`,
//! `.startswith()`, `.items()`), `raise_exception`, `strftime_now`, and `tojson` as Python's
//! `json.dumps(ensure_ascii=False)` writes (`", "` and `": "` between items, no HTML escaping,
//! which minijinja's own filter does).

use super::Message;
use minijinja::{context, Environment, Error, ErrorKind, Value};

/// A model's chat template, compiled once.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl ChatTemplate {
    /// Compiles `source`; its error is the model's (a template that does not parse).
    pub fn new(
        source: String,
        bos_token: Option<String>,
        eos_token: Option<String>,
    ) -> Result<Self, String> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Value, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |format: String| {
            chrono::Utc::now().format(&format).to_string()
        });
        env.add_filter("tojson", tojson);
        env.add_template_owned("chat", source)
            .map_err(|e| format!("chat template: {e}"))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt for `messages`, ending with the template's opening of the assistant's turn.
    /// Its error (a `raise_exception` of the template, a value it cannot use) is the record's.
    pub fn render(&self, messages: &[Message]) -> Result<String, String> {
        let template = self.env.get_template("chat").map_err(|e| e.to_string())?;
        template
            .render(context! {
                messages => messages,
                add_generation_prompt => true,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
                tools => Value::from(()),
            })
            .map_err(|e| format!("chat template: {}", describe(&e)))
    }
}

/// The error's message without minijinja's template listing.
fn describe(e: &Error) -> String {
    match e.detail() {
        Some(detail) => detail.to_string(),
        None => e.kind().to_string(),
    }
}

/// `value | tojson(indent=None)` as transformers' filter writes it.
fn tojson(value: Value, indent: Option<usize>) -> Result<Value, Error> {
    let mut out = String::new();
    write_json(&value, indent, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// Python's `json.dumps(ensure_ascii=False)` layout, keys in their order: `", "` and `": "`
/// inline, or one item a line under `indent`.
fn write_json(
    v: &Value,
    indent: Option<usize>,
    depth: usize,
    out: &mut String,
) -> Result<(), Error> {
    use minijinja::value::ValueKind;
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.push_str(&" ".repeat(n * depth));
        }
    };
    let sep = if indent.is_some() { "," } else { ", " };
    let kind = v.kind();
    if matches!(kind, ValueKind::Seq | ValueKind::Map) {
        let (open, close) = if kind == ValueKind::Seq {
            ('[', ']')
        } else {
            ('{', '}')
        };
        out.push(open);
        let mut empty = true;
        for (i, item) in v.try_iter()?.enumerate() {
            empty = false;
            if i > 0 {
                out.push_str(sep);
            }
            newline(out, depth + 1);
            if kind == ValueKind::Map {
                out.push_str(&serde_json::Value::String(item.to_string()).to_string());
                out.push_str(": ");
                write_json(&v.get_item(&item)?, indent, depth + 1, out)?;
            } else {
                write_json(&item, indent, depth + 1, out)?;
            }
        }
        if !empty {
            newline(out, depth);
        }
        out.push(close);
        return Ok(());
    }
    let json = serde_json::to_value(v)
        .map_err(|e| Error::new(ErrorKind::BadSerialization, e.to_string()))?;
    out.push_str(&json.to_string());
    Ok(())
}
