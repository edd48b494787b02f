//! Logging: the global `tracing` subscriber, writing text or JSON lines to stderr, the JSON in
//! the shape Cloud Logging reads (`severity`, the event's fields at the top level, its spans).

use crate::choice::Choice;

/// Log output format (`SPOTINFER_LOG_FORMAT`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, with Cloud Logging's `severity` field.
    Json,
}

impl Choice for LogFormat {
    const NAMES: &'static [(&'static str, Self)] = &[("text", Self::Text), ("json", Self::Json)];
}

/// Installs the global tracing subscriber. `RUST_LOG` filters (default `info`, PostgreSQL's
/// notices at `warn`). Logs go to
/// stderr so stdout stays clean for command output.
pub fn init_logging(format: LogFormat) {
    use tracing_subscriber::EnvFilter;
    // PostgreSQL's notices ("relation … already exists, skipping" on every migration run) say
    // nothing an operator can act on: shown from RUST_LOG=sqlx::postgres::notice=info.
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx::postgres::notice=warn"));
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        // No colour codes inside JSON strings (span fields are pre-formatted text).
        LogFormat::Json => builder
            .with_ansi(false)
            .event_format(CloudLoggingJson)
            .try_init(),
    };
}

/// A JSON event format with `severity` (Cloud Logging's name for the level), `message`,
/// `target`, `timestamp`, the event's fields at the top level under their own names, and the
/// enclosing spans (name and fields, outermost first) under `spans`.
///
/// Kept rather than `tracing-stackdriver` because that layer renames every field to camelCase
/// (`retry_in` becomes `retryIn`, `drain_seconds` becomes `drainSeconds`) and writes `time` for
/// `timestamp`: the field names operators query and alert on (docs/operations.md) would change.
struct CloudLoggingJson;

impl<S, N> tracing_subscriber::fmt::FormatEvent<S, N> for CloudLoggingJson
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    N: for<'a> tracing_subscriber::fmt::FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &tracing_subscriber::fmt::FmtContext<'_, S, N>,
        mut writer: tracing_subscriber::fmt::format::Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let mut fields = JsonFields(serde_json::Map::new());
        event.record(&mut fields);
        let mut obj = fields.0;
        let severity = match *event.metadata().level() {
            tracing::Level::ERROR => "ERROR",
            tracing::Level::WARN => "WARNING",
            tracing::Level::INFO => "INFO",
            tracing::Level::DEBUG | tracing::Level::TRACE => "DEBUG",
        };
        obj.insert("severity".into(), severity.into());
        if let Some(scope) = ctx.event_scope() {
            let spans: Vec<serde_json::Value> = scope
                .from_root()
                .map(|span| {
                    let ext = span.extensions();
                    let fields = ext
                        .get::<tracing_subscriber::fmt::FormattedFields<N>>()
                        .map(|f| f.fields.clone())
                        .unwrap_or_default();
                    serde_json::json!({"name": span.name(), "fields": fields})
                })
                .collect();
            if !spans.is_empty() {
                obj.insert("spans".into(), spans.into());
            }
        }
        obj.insert("target".into(), event.metadata().target().into());
        obj.insert(
            "timestamp".into(),
            chrono::Utc::now()
                .to_rfc3339_opts(chrono::SecondsFormat::Micros, true)
                .into(),
        );
        let line = serde_json::Value::Object(obj).to_string();
        writeln!(writer, "{line}")
    }
}

struct JsonFields(serde_json::Map<String, serde_json::Value>);

impl tracing::field::Visit for JsonFields {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        self.0
            .insert(field.name().into(), format!("{value:?}").into());
    }
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_i64(&mut self, field: &tracing::field::Field, value: i64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_u64(&mut self, field: &tracing::field::Field, value: u64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_f64(&mut self, field: &tracing::field::Field, value: f64) {
        self.0.insert(field.name().into(), value.into());
    }
    fn record_bool(&mut self, field: &tracing::field::Field, value: bool) {
        self.0.insert(field.name().into(), value.into());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    /// An event inside spans carries them: name and fields, outermost first.
    #[test]
    fn json_logs_keep_span_fields() {
        use tracing_subscriber::fmt::MakeWriter;
        #[derive(Clone, Default)]
        struct Buf(Arc<std::sync::Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        impl<'a> MakeWriter<'a> for Buf {
            type Writer = Buf;
            fn make_writer(&'a self) -> Buf {
                self.clone()
            }
        }
        let buf = Buf::default();
        let subscriber = tracing_subscriber::fmt()
            .with_ansi(false)
            .event_format(CloudLoggingJson)
            .with_writer(buf.clone())
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            let outer = tracing::info_span!("batch", records = 32);
            let _o = outer.enter();
            let inner = tracing::info_span!("commit", attempt = 2);
            let _i = inner.enter();
            tracing::warn!(retry_in = 5, "commit failed");
        });
        let text = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let line: serde_json::Value = serde_json::from_str(text.trim()).unwrap();
        assert_eq!(line["severity"], "WARNING");
        assert_eq!(line["retry_in"], 5);
        assert_eq!(line["spans"][0]["name"], "batch");
        assert_eq!(line["spans"][0]["fields"], "records=32");
        assert_eq!(line["spans"][1]["name"], "commit");
        assert_eq!(line["spans"][1]["fields"], "attempt=2");
    }
}
