//! Keeping passwords out of everything we print, log or store.

/// The URL with its password replaced by `***`.
pub fn url(u: &str) -> String {
    match url::Url::parse(u) {
        Ok(mut parsed) if parsed.password().is_some() => {
            let _ = parsed.set_password(Some("***"));
            parsed.to_string()
        }
        Ok(parsed) => parsed.to_string(),
        Err(_) => "<unparseable URL>".into(),
    }
}

/// An error message with any appearance of the URL's password (raw or percent-encoded) masked.
pub fn error(message: &str, u: &str) -> String {
    let mut out = message.to_string();
    if let Ok(parsed) = url::Url::parse(u) {
        if let Some(p) = parsed.password().filter(|p| !p.is_empty()) {
            out = out.replace(p, "***");
            if let Ok(decoded) = urlencoding_decode(p) {
                if !decoded.is_empty() {
                    out = out.replace(&decoded, "***");
                }
            }
        }
    }
    out
}

fn urlencoding_decode(s: &str) -> Result<String, std::string::FromUtf8Error> {
    let bytes: Vec<u8> = url::form_urlencoded::parse(format!("x={s}").as_bytes())
        .next()
        .map(|(_, v)| v.into_owned().into_bytes())
        .unwrap_or_default();
    String::from_utf8(bytes)
}

#[cfg(test)]
mod tests {
    #[test]
    fn masks_passwords() {
        assert_eq!(
            super::url("amqp://u:p%40ss@h:5672/v"),
            "amqp://u:***@h:5672/v"
        );
        assert_eq!(
            super::error("bad p@ss here", "amqp://u:p%40ss@h/"),
            "bad *** here"
        );
    }
}
