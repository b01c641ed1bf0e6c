//! Reading JSON as it arrives: where a value ends (or that the text ends inside it), and the
//! `{"name": …, "arguments": {…}}` call objects several tool formats use, with the arguments
//! known as a span of the text while they are still being written.

/// The end of the JSON value that starts at `s` (after leading whitespace): `Ok(Some(end))`
/// when it is complete, `Ok(None)` when the text ends inside it, `Err(at)` when it is not
/// JSON, `at` being the first byte that shows it (for a value complete in structure but
/// refused whole, its end). More text can never move `at` back.
pub fn value_end(s: &str) -> Result<Option<usize>, usize> {
    let b = s.as_bytes();
    let mut i = skip_ws(s, 0);
    if i >= b.len() {
        return Ok(None);
    }
    let start = i;
    let mut stack: Vec<u8> = Vec::new();
    loop {
        if i >= b.len() {
            return Ok(None);
        }
        match b[i] {
            b'"' => match string_end(b, i)? {
                Some(e) => i = e,
                None => return Ok(None),
            },
            b'{' | b'[' => {
                stack.push(b[i]);
                i += 1;
            }
            b'}' | b']' => {
                let open = stack.pop().ok_or(i)?;
                if (open == b'{') != (b[i] == b'}') {
                    return Err(i);
                }
                i += 1;
            }
            b',' | b':' if !stack.is_empty() => i += 1,
            c if c.is_ascii_whitespace() && !stack.is_empty() => i += 1,
            b'-' | b'0'..=b'9' | b't' | b'f' | b'n' => {
                // A scalar runs to the next delimiter; at the end of the text it may go on.
                let e = b[i..]
                    .iter()
                    .position(|c| matches!(c, b',' | b'}' | b']' | b':') || c.is_ascii_whitespace())
                    .map(|p| i + p);
                match e {
                    Some(e) => i = e,
                    None => {
                        if stack.is_empty() && matches!(&s[i..], "true" | "false" | "null") {
                            i = b.len();
                        } else {
                            return Ok(None);
                        }
                    }
                }
            }
            _ => return Err(i),
        }
        if stack.is_empty() {
            // Checked whole once complete (the scan above only follows the structure).
            return match serde_json::from_str::<serde::de::IgnoredAny>(&s[start..i]) {
                Ok(_) => Ok(Some(i)),
                Err(_) => Err(i),
            };
        }
    }
}

/// The end (after the closing quote) of the JSON string starting at `b[i] == '"'`.
fn string_end(b: &[u8], mut i: usize) -> Result<Option<usize>, usize> {
    i += 1;
    while i < b.len() {
        match b[i] {
            b'\\' => i += 2,
            b'"' => return Ok(Some(i + 1)),
            c if c < 0x20 => return Err(i),
            _ => i += 1,
        }
    }
    Ok(None)
}

pub fn skip_ws(s: &str, mut i: usize) -> usize {
    let b = s.as_bytes();
    while i < b.len() && b[i].is_ascii_whitespace() {
        i += 1;
    }
    i
}

/// A call object read so far.
#[derive(Debug, Default, PartialEq)]
pub struct CallObject {
    pub name: Option<String>,
    /// The model's own id for the call, if it wrote one (`"id"`).
    pub id: Option<String>,
    /// Byte span of the arguments value in the text, as far as it goes (up to where it broke).
    pub args: Option<(usize, usize)>,
    /// The arguments value is an object (`{` first): only then is it a call's arguments.
    pub args_object: bool,
    /// Where the object ends, once it does.
    pub end: Option<usize>,
}

/// Reads a `{"name": "…", "<args key>": {…}}` object starting at `s` (after whitespace);
/// other keys are skipped. `Err` (with what was read before, and where it broke) when the
/// text is not such an object.
pub fn call_object(s: &str, arg_keys: &[&str]) -> Result<CallObject, (CallObject, usize)> {
    let mut c = CallObject::default();
    match read_call(s, arg_keys, &mut c) {
        Ok(()) => Ok(c),
        Err(at) => Err((c, at)),
    }
}

fn read_call(s: &str, arg_keys: &[&str], c: &mut CallObject) -> Result<(), usize> {
    let b = s.as_bytes();
    let mut i = skip_ws(s, 0);
    if i >= b.len() {
        return Ok(());
    }
    if b[i] != b'{' {
        return Err(i);
    }
    i += 1;
    loop {
        i = skip_ws(s, i);
        if i >= b.len() {
            return Ok(());
        }
        if b[i] == b'}' {
            c.end = Some(i + 1);
            return Ok(());
        }
        if b[i] != b'"' {
            return Err(i);
        }
        let Some(key_end) = string_end(b, i)? else {
            return Ok(());
        };
        let key: String = serde_json::from_str(&s[i..key_end]).map_err(|_| key_end)?;
        i = skip_ws(s, key_end);
        if i >= b.len() {
            return Ok(());
        }
        if b[i] != b':' {
            return Err(i);
        }
        i = skip_ws(s, i + 1);
        if i >= b.len() {
            return Ok(());
        }
        let is_args = arg_keys.contains(&key.as_str()) && c.args.is_none();
        if is_args {
            c.args_object = b[i] == b'{';
            c.args = Some((i, s.len()));
        }
        let e = match value_end(&s[i..]) {
            Ok(Some(e)) => e,
            Ok(None) => return Ok(()),
            Err(at) => {
                if is_args {
                    c.args = Some((i, i + at));
                }
                return Err(i + at);
            }
        };
        let (vs, ve) = (i, i + e);
        match key.as_str() {
            "name" if c.name.is_none() => c.name = Some(serde_json::from_str::<String>(&s[vs..ve]).map_err(|_| ve)?),
            "id" => c.id = serde_json::from_str::<String>(&s[vs..ve]).ok(),
            _ if is_args => c.args = Some((vs, ve)),
            _ => {}
        }
        i = skip_ws(s, ve);
        if i >= b.len() {
            return Ok(());
        }
        match b[i] {
            b',' => i += 1,
            b'}' => {
                c.end = Some(i + 1);
                return Ok(());
            }
            _ => return Err(i),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn value_end_finds_ends_and_incomplete_values() {
        assert_eq!(value_end(r#"{"a": [1, "x}"]} rest"#), Ok(Some(16)));
        assert_eq!(value_end(r#"  {"a": 1"#), Ok(None));
        assert_eq!(value_end(r#""abc\"d""#), Ok(Some(8)));
        assert_eq!(value_end("12"), Ok(None));
        assert_eq!(value_end("12,"), Ok(Some(2)));
        assert_eq!(value_end("true"), Ok(Some(4)));
        assert_eq!(value_end("{]"), Err(1));
        assert_eq!(value_end("{\"a\" 1}"), Err(7));
        assert_eq!(value_end("<x>"), Err(0));
    }

    #[test]
    fn call_objects_are_read_as_they_arrive() {
        let text = r#"{"name": "f", "arguments": {"city": "Pa"#;
        let c = call_object(text, &["arguments"]).unwrap();
        assert_eq!(c.name.as_deref(), Some("f"));
        assert_eq!(&text[c.args.unwrap().0..c.args.unwrap().1], r#"{"city": "Pa"#);
        assert!(c.args_object && c.end.is_none());
        let text = r#"{"name": "f", "parameters": {"x": 1}, "id": "abc"} tail"#;
        let c = call_object(text, &["arguments", "parameters"]).unwrap();
        assert_eq!(c.end, Some(text.len() - 5));
        assert_eq!(c.id.as_deref(), Some("abc"));
        assert!(call_object("[1]", &["arguments"]).is_err());
        // Broken after the arguments began: what was read is kept.
        let (e, at) = call_object(r#"{"name": "f", "arguments": {"a": ]"#, &["arguments"]).unwrap_err();
        assert_eq!(e.name.as_deref(), Some("f"));
        assert_eq!((e.args, at), (Some((27, 33)), 33));
    }
}
