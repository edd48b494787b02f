//! How flag values are read and bounded: durations with their ranges (named with the flag when
//! refused), the limits several flags share, and the parser every [`Choice`] enum gets.

use crate::choice::Choice;
use clap::builder::{PossibleValuesParser, TypedValueParser};
use std::time::Duration;

/// Parses `500ms`, `10s`, `2m`, …
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 500ms or 10s: {e}"))
}

/// A duration Pub/Sub accepts for an ack deadline or lease extension: 10 s to 600 s.
pub(crate) fn lease_seconds(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if (Duration::from_secs(10)..=Duration::from_secs(600)).contains(&d) {
        Ok(d)
    } else {
        Err(format!("{s} is outside Pub/Sub's range of 10s to 600s"))
    }
}

/// A parser for durations from `min` to `max`, both included. Its error names the range; clap
/// puts the flag's name before it. Every duration flag has one: a zero poll interval would be a
/// busy loop, a zero timeout a failure on every try.
pub(crate) fn duration_in(
    min: Duration,
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync + 'static {
    move |s| {
        let d = parse_duration(s)?;
        if (min..=max).contains(&d) {
            Ok(d)
        } else {
            Err(format!(
                "{s} is outside the range {} to {}",
                humantime::format_duration(min),
                humantime::format_duration(max)
            ))
        }
    }
}

pub(crate) const fn secs(n: u64) -> Duration {
    Duration::from_secs(n)
}

pub(crate) const fn millis(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// The parser of a [`Choice`]: its names listed in `--help`, any other refused by clap.
pub(crate) fn choice<T: Choice>() -> impl TypedValueParser<Value = T> {
    let names: Vec<&'static str> = T::NAMES.iter().map(|(n, _)| *n).collect();
    PossibleValuesParser::new(names)
        .try_map(|name: String| T::from_name(&name).ok_or(format!("no such choice: {name}")))
}

/// Largest `--batch-size`: far past where a bigger batch speeds up any backend, and small
/// enough that one batch's rows stay a few statements under the SQL bind-parameter limits.
pub const MAX_BATCH_SIZE: u64 = 4096;

/// Pub/Sub's largest message, which bounds any inline text.
pub const MAX_MESSAGE_BYTES: u64 = 10_000_000;
