//! A record's message: the input row's record, checked against the worker's own contract
//! (`record::parse`) and written back as the message data, with the job stamped in.

use crate::jobs::input::MAX_LINE_BYTES;
use crate::record;

/// The record id and message data for a line (a JSON line, or the record a table row made),
/// `None` for a blank line, or why the line is refused. With a `job`, a record that names another job is refused: a job's count must hold
/// exactly what was published to it.
pub fn message_data(line: &[u8], job: Option<&str>) -> Result<Option<(String, String)>, String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    // Lines are bytes: an invalid UTF-8 line is refused like any other bad line.
    let mut rec = record::parse(line, usize::MAX).map_err(|e| e.to_string())?;
    match (&rec.job, job) {
        (Some(own), Some(j)) if own != j => {
            return Err(format!("the record names job {own:?}, not {j:?}"));
        }
        (None, _) => rec.job = job.map(str::to_string),
        _ => {}
    }
    let data = record_json(&rec).to_string();
    // The message is the record re-written (with the job added): it can outgrow the line.
    if data.len() > MAX_LINE_BYTES {
        return Err(format!(
            "the message would be {} bytes, more than {MAX_LINE_BYTES} (Pub/Sub's message limit)",
            data.len()
        ));
    }
    Ok(Some((rec.id, data)))
}

/// The message data for a parsed record: what the worker's contract reads, nothing else.
fn record_json(rec: &record::Record) -> serde_json::Value {
    let inline = match &rec.image {
        Some(record::Image {
            data: record::ImageData::Encoded(bytes),
            ..
        }) => Some(bytes),
        _ => None,
    };
    if let Some(g) = &rec.generation {
        return generation_json(rec, g);
    }
    let mut data = match (&rec.uri, inline) {
        (Some(uri), _) => serde_json::json!({"id": rec.id, "uri": uri, "job": rec.job}),
        (None, Some(bytes)) => {
            use base64::Engine;
            let b64 = base64::engine::general_purpose::STANDARD.encode(bytes);
            serde_json::json!({"id": rec.id, "image_base64": b64, "job": rec.job})
        }
        (None, None) => serde_json::json!({"id": rec.id, "text": rec.text, "job": rec.job}),
    };
    if let Some(name) = &rec.prompt_name {
        data["prompt_name"] = serde_json::Value::from(name.as_str());
    }
    if let Some(pair) = &rec.text_pair {
        data["text_pair"] = serde_json::Value::from(pair.as_str());
    }
    data
}

/// A generation record's message data: its prompt or messages and the options it gave (its
/// seed written out, the one the worker would derive from the id when it gave none).
fn generation_json(
    rec: &record::Record,
    g: &crate::record::generation::Input,
) -> serde_json::Value {
    use crate::record::generation::Prompt;
    let mut data = serde_json::json!({"id": rec.id, "job": rec.job, "seed": g.seed});
    match &g.prompt {
        Prompt::Raw(p) => data["prompt"] = p.as_str().into(),
        Prompt::Chat(m) => data["messages"] = serde_json::json!(m),
    }
    let options = [
        (
            "max_new_tokens",
            g.max_new_tokens.map(serde_json::Value::from),
        ),
        ("temperature", g.temperature.map(serde_json::Value::from)),
        ("top_p", g.top_p.map(serde_json::Value::from)),
        ("top_k", g.top_k.map(serde_json::Value::from)),
    ];
    for (key, value) in options {
        if let Some(v) = value {
            data[key] = v;
        }
    }
    if !g.stop.is_empty() {
        data["stop"] = serde_json::json!(g.stop);
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_record_keeps_its_prompt_name_and_pair_and_gains_the_job() {
        let line = br#"{"id":"q1","text":"how far","prompt_name":"query","text_pair":"a mile"}"#;
        let (id, data) = message_data(line, Some("j"))
            .expect("a valid line")
            .expect("not blank");
        assert_eq!(id, "q1");
        let back = record::parse(data.as_bytes(), usize::MAX).expect("the worker reads it");
        assert_eq!(back.prompt_name.as_deref(), Some("query"));
        assert_eq!(back.text_pair.as_deref(), Some("a mile"));
        assert_eq!(back.job.as_deref(), Some("j"));
        assert_eq!(back.text, "how far");
    }

    #[test]
    fn a_record_naming_another_job_is_not_counted_in_this_one() {
        let line = br#"{"id":"a","text":"t","job":"other"}"#;
        let refused = message_data(line, Some("j")).expect_err("another job's record");
        assert!(refused.contains("names job \"other\""), "{refused}");
        assert!(matches!(message_data(line, None), Ok(Some(_))));
        assert!(matches!(message_data(line, Some("other")), Ok(Some(_))));
        assert_eq!(
            message_data(b"  \t", Some("j")),
            Ok(None),
            "blank: not refused"
        );
    }
}
