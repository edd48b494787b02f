//! A record's message: the input row's record, checked against the worker's own contract
//! (`record::parse`) and written back as the message data, with the job stamped in.

use crate::jobs::input::MAX_LINE_BYTES;
use crate::record;
use crate::record::generation::Constraint;

/// The record id and message data for a line (a JSON line, or the record a table row made),
/// `None` for a blank line, or why the line is refused. With a `job`, a record that names
/// another job is refused: a job's count must hold exactly what was published to it. With a
/// `constraint`, a generation record that gives none takes it, and any other record is refused.
pub fn message_data(
    line: &[u8],
    job: Option<&str>,
    constraint: Option<&Constraint>,
) -> Result<Option<(String, String)>, String> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let converted = openai_batch_record(line)?;
    let line = converted.as_deref().unwrap_or(line);
    // Lines are bytes: an invalid UTF-8 line is refused like any other bad line.
    let mut rec = record::parse(line, usize::MAX).map_err(|e| e.to_string())?;
    match (&rec.job, job) {
        (Some(own), Some(j)) if own != j => {
            return Err(format!("the record names job {own:?}, not {j:?}"));
        }
        (None, _) => rec.job = job.map(str::to_string),
        _ => {}
    }
    match (&mut rec.generation, constraint) {
        (_, None) => {}
        (Some(g), Some(c)) if g.constraint.is_none() => {
            std::sync::Arc::make_mut(g).constraint = Some(c.clone());
        }
        (Some(_), Some(_)) => {}
        (None, Some(_)) => {
            return Err("--response-format is for generation records (messages or a prompt)".into())
        }
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

/// The record an OpenAI batch request line asks for, as a JSON line (`None`: the line is no such
/// request, and is read as a record).
fn openai_batch_record(line: &[u8]) -> Result<Option<Vec<u8>>, String> {
    // Only a line that starts as an object can be one; others skip the extra parse.
    if !line.trim_ascii_start().starts_with(b"{") || !contains(line, b"\"custom_id\"") {
        return Ok(None);
    }
    let Ok(serde_json::Value::Object(map)) = serde_json::from_slice(line) else {
        return Ok(None);
    };
    if !super::openai_batch::is_batch_line(&map) {
        return Ok(None);
    }
    let record = super::openai_batch::record(&map)?;
    Ok(Some(
        serde_json::Value::Object(record).to_string().into_bytes(),
    ))
}

fn contains(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
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
    if let Some(c) = &g.constraint {
        let (key, value) = c.field();
        data[key] = value;
    }
    data
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_published_record_keeps_its_prompt_name_and_pair_and_gains_the_job() {
        let line = br#"{"id":"q1","text":"how far","prompt_name":"query","text_pair":"a mile"}"#;
        let (id, data) = message_data(line, Some("j"), None)
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
    fn a_generation_record_keeps_its_options_and_its_constraint() {
        let schema = r#"{"type":"object","properties":{"a":{"enum":[1,2]}},"required":["a"]}"#;
        let lines = [
            format!(
                r#"{{"id":"g","messages":[{{"role":"user","content":"hi"}}],"max_new_tokens":9,"stop":"x","response_format":{{"type":"json_schema","json_schema":{{"name":"n","schema":{schema}}}}}}}"#
            ),
            r#"{"id":"g","prompt":"p","response_format":{"type":"json_object"}}"#.into(),
            r#"{"id":"g","prompt":"p","regex":"[0-9]+"}"#.into(),
            r#"{"id":"g","prompt":"p","grammar":"start: \"a\""}"#.into(),
        ];
        for line in lines {
            let (_, data) = message_data(line.as_bytes(), None, None).unwrap().unwrap();
            let sent = record::parse(line.as_bytes(), usize::MAX)
                .unwrap()
                .generation;
            let back = record::parse(data.as_bytes(), usize::MAX)
                .unwrap()
                .generation;
            assert!(
                sent.as_ref().is_some_and(|g| g.constraint.is_some()),
                "{line}"
            );
            assert_eq!(back, sent, "{line}");
            assert_eq!(
                back.map(|g| g.sha256()),
                sent.map(|g| g.sha256()),
                "the worker keys the record's checkpoint by it"
            );
        }
    }

    #[test]
    fn a_jobs_constraint_goes_to_generation_records_without_one_and_refuses_others() {
        let job = Constraint::Regex("[a-z]+".into());
        let constraint = |line: &str| {
            let (_, data) = message_data(line.as_bytes(), None, Some(&job))
                .unwrap()
                .unwrap();
            let rec = record::parse(data.as_bytes(), usize::MAX).unwrap();
            rec.generation.unwrap().constraint.clone()
        };
        assert_eq!(constraint(r#"{"id":"a","prompt":"p"}"#), Some(job.clone()));
        assert_eq!(
            constraint(r#"{"id":"b","prompt":"p","regex":"[0-9]+"}"#),
            Some(Constraint::Regex("[0-9]+".into())),
            "a record's own constraint stays"
        );
        let text = message_data(br#"{"id":"c","text":"t"}"#, None, Some(&job));
        assert!(text.unwrap_err().contains("for generation records"));
    }

    #[test]
    fn a_record_naming_another_job_is_not_counted_in_this_one() {
        let line = br#"{"id":"a","text":"t","job":"other"}"#;
        let refused = message_data(line, Some("j"), None).expect_err("another job's record");
        assert!(refused.contains("names job \"other\""), "{refused}");
        assert!(matches!(message_data(line, None, None), Ok(Some(_))));
        assert!(matches!(
            message_data(line, Some("other"), None),
            Ok(Some(_))
        ));
        assert_eq!(
            message_data(b"  \t", Some("j"), None),
            Ok(None),
            "blank: not refused"
        );
    }
}
