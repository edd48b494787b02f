//! The database URL made safe to print: the store's errors and the commands' logs name the
//! database they talk to, never its password.
//!
//! The URL to hide a password in may be malformed: a password holding `?`, `#`, `/` or `@`
//! unescaped is exactly what makes it so, and such a URL still reaches the logs (in the error
//! that says it cannot be parsed, on every connect retry). So the scan never trusts the URL's
//! delimiters inside a password: where it cannot tell, it hides more than needed, never less.

/// The URL (or libpq `key=value` string) with any password replaced by `***`, safe for logs.
pub fn redact_url(url: &str) -> String {
    if url.contains("://") {
        redact_query_password(&redact_userinfo(url))
    } else {
        redact_key_values(url)
    }
}

/// `scheme://user:***@host…`: the password of the userinfo hidden.
///
/// The userinfo ends at the last `@` of the whole URL: a password may hold `@`, `?`, `#` and
/// `/` unescaped, so no delimiter before that `@` can be trusted to end it. A user name holds no
/// `:` (it must be escaped there), so the first `:` starts the password. Should an `@` follow
/// the host (in a query value), more is hidden than needed, never less.
fn redact_userinfo(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    let Some(at) = rest.rfind('@') else {
        return url.to_string();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end + 3],
            &rest[..colon],
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

/// `…?password=***&…`: every query parameter whose name ends in `password` (`password`,
/// `sslpassword`, any case, percent-escaped or not, as sqlx decodes names) hidden, with
/// whatever follows it up to the next `&name=`: a value may hold `&`, `#` or `=` unescaped.
fn redact_query_password(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let mut params: Vec<String> = Vec::new();
    let mut hiding = false;
    for p in query.split('&') {
        let name = p
            .split_once('=')
            .map(|(k, _)| k)
            .filter(|k| plausible_name(k));
        match name {
            Some(k) if is_password_name(k) => {
                params.push(format!("{k}=***"));
                hiding = true;
            }
            Some(_) => {
                params.push(p.to_string());
                hiding = false;
            }
            None if hiding => {}
            None => params.push(p.to_string()),
        }
    }
    format!("{base}?{}", params.join("&"))
}

/// libpq's `key=value` form: `password=…` (spaces around `=` allowed, the value bare up to the
/// next space or single-quoted with `\'` escapes) replaced by `password=***`.
fn redact_key_values(conninfo: &str) -> String {
    let mut out = String::with_capacity(conninfo.len());
    let mut rest = conninfo;
    while let Some(eq) = rest.find('=') {
        let key_start = rest[..eq]
            .trim_end()
            .rfind(char::is_whitespace)
            .map_or(0, |i| i + 1);
        let key = rest[key_start..eq].trim();
        let value = rest[eq + 1..].trim_start();
        let value_start = rest.len() - value.len();
        let value_len = if let Some(quoted) = value.strip_prefix('\'') {
            quoted_len(quoted) + 1
        } else {
            value.find(char::is_whitespace).unwrap_or(value.len())
        };
        if is_password_name(key) {
            out.push_str(&rest[..key_start]);
            out.push_str(key);
            out.push_str("=***");
        } else {
            out.push_str(&rest[..value_start + value_len]);
        }
        rest = &rest[value_start + value_len..];
    }
    out.push_str(rest);
    out
}

/// The length of a single-quoted libpq value after its opening quote, closing quote included
/// (the whole rest when it is never closed).
fn quoted_len(quoted: &str) -> usize {
    let mut escaped = false;
    for (i, c) in quoted.char_indices() {
        match c {
            _ if escaped => escaped = false,
            '\\' => escaped = true,
            '\'' => return i + 1,
            _ => {}
        }
    }
    quoted.len()
}

/// Whether a parameter name (percent-escapes decoded) names a password.
fn is_password_name(name: &str) -> bool {
    percent_encoding::percent_decode_str(name)
        .decode_utf8_lossy()
        .to_ascii_lowercase()
        .ends_with("password")
}

/// Whether `name` can be a query parameter's name rather than the middle of a value.
fn plausible_name(name: &str) -> bool {
    !name.is_empty()
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-' | b'.' | b'%'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_reach_logs() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5432/db"),
            "postgres://u:***@h:5432/db"
        );
        assert_eq!(redact_url("sqlite://x.db"), "sqlite://x.db");
    }

    #[test]
    fn a_password_holding_at_signs_is_hidden_whole() {
        let r = redact_url("postgres://u:p@ss@w0rd@h:5432/db");
        assert_eq!(r, "postgres://u:***@h:5432/db");
        assert!(!r.contains("ss") && !r.contains("w0rd"), "{r}");
    }

    #[test]
    fn passwords_in_the_query_are_redacted_too() {
        assert_eq!(
            redact_url("postgres://u@h/db?sslmode=require&password=secret&sslpassword=other"),
            "postgres://u@h/db?sslmode=require&password=***&sslpassword=***"
        );
        assert_eq!(
            redact_url("postgres://u:a@h/db?PASSWORD=b"),
            "postgres://u:***@h/db?PASSWORD=***"
        );
    }

    /// Issue 40: a password holding `?`, `#` or `/` ended the userinfo early in the old scan, and
    /// the whole URL was printed as it was.
    #[test]
    fn a_password_holding_url_delimiters_is_hidden_whole() {
        for (url, secret) in [
            ("postgres://u:se?cr#et@h:5432/db", "se?cr#et"),
            ("postgres://u:se#cret@h/db?sslmode=require", "se#cret"),
            ("postgres://u:se/cr?et@h/db", "se/cr?et"),
            ("postgres://u:p@s?s#w/d@h/db?sslmode=require", "p@s?s#w/d"),
            ("postgresql://u:p%3Fss%40w%23rd@h/db", "p%3Fss%40w%23rd"),
            ("postgres://u:?#@h/db", "?#"),
        ] {
            let r = redact_url(url);
            assert!(!r.contains(secret), "{url} -> {r}");
            assert!(
                r.starts_with(&url[..url.find(':').unwrap()]),
                "{url} -> {r}"
            );
            assert!(r.contains("u:***@"), "{url} -> {r}");
            assert!(
                r.ends_with("h/db") || r.contains("@h"),
                "the host stays: {url} -> {r}"
            );
        }
        assert_eq!(
            redact_url("postgres://u:se?cr#et@h:5432/db?sslmode=require"),
            "postgres://u:***@h:5432/db?sslmode=require"
        );
    }

    /// A `password=` parameter's value may hold `&`, `#` or `=` unescaped; what follows it up to
    /// the next parameter is hidden, and a percent-escaped name is read as sqlx reads it.
    #[test]
    fn query_passwords_with_delimiters_and_escaped_names_are_hidden() {
        let r = redact_url("postgres://h/db?user=u&password=se&cr#e=t&sslmode=require");
        assert_eq!(r, "postgres://h/db?user=u&password=***&sslmode=require");
        let r = redact_url("postgres://h/db?pass%77ord=secret&sslmode=require");
        assert!(!r.contains("secret"), "{r}");
    }

    /// libpq's key=value form (`host=h password=…`), quoted or not.
    #[test]
    fn key_value_passwords_are_hidden() {
        assert_eq!(
            redact_url("host=h user=u password=se?cr#et dbname=d"),
            "host=h user=u password=*** dbname=d"
        );
        let r = redact_url(r"host=h password = 'se cr\'et x' dbname=d");
        assert!(!r.contains("se cr") && !r.contains("et x"), "{r}");
        assert!(r.ends_with("dbname=d"), "{r}");
    }
}
