//! The database URL made safe to print: the store's errors and the commands' logs name the
//! database they talk to, never its password.

/// The URL with any password replaced by `***`, safe for logs.
pub fn redact_url(url: &str) -> String {
    redact_query_password(&redact_userinfo(url))
}

/// `scheme://user:***@host…`: the password of the userinfo hidden.
fn redact_userinfo(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_string();
    };
    let rest = &url[scheme_end + 3..];
    // The userinfo ends at the last `@` before the query, as URL parsers read it: a password
    // may hold `@` itself, and cutting at the first one would print the rest of it. Should a
    // path hold an `@`, more is hidden than needed, never less.
    let before_query = rest.find(['?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..before_query].rfind('@') else {
        return url.to_string();
    };
    let userinfo = &rest[..at];
    match userinfo.find(':') {
        Some(colon) => format!(
            "{}{}:***{}",
            &url[..scheme_end + 3],
            &userinfo[..colon],
            &rest[at..]
        ),
        None => url.to_string(),
    }
}

/// `…?password=***&…`: every query parameter whose name ends in `password` (`password`,
/// `sslpassword`, any case) hidden.
fn redact_query_password(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_string();
    };
    let params: Vec<String> = query
        .split('&')
        .map(|p| match p.split_once('=') {
            Some((k, _)) if k.to_ascii_lowercase().ends_with("password") => format!("{k}=***"),
            _ => p.to_string(),
        })
        .collect();
    format!("{base}?{}", params.join("&"))
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
}
