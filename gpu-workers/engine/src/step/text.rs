//! Turning generated token bytes into streamed text: holds back incomplete UTF-8 and any
//! tail that could still become a stop string, and cuts the text at the first stop string.

/// Incremental detokenizer with stop strings.
#[derive(Debug, Default)]
pub struct TextStream {
    stops: Vec<String>,
    /// Bytes not yet forming complete UTF-8.
    bytes: Vec<u8>,
    /// Decoded text not yet released (a possible stop-string prefix).
    held: String,
}

/// What one token released.
#[derive(Debug, PartialEq)]
pub struct Released {
    pub text: String,
    /// A stop string was found; generation must end (the stop string is not in `text`).
    pub stopped: bool,
}

impl TextStream {
    pub fn new(stops: &[String]) -> Self {
        Self {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            ..Default::default()
        }
    }

    pub fn push(&mut self, token_bytes: &[u8]) -> Released {
        self.bytes.extend_from_slice(token_bytes);
        loop {
            match std::str::from_utf8(&self.bytes) {
                Ok(s) => {
                    self.held.push_str(s);
                    self.bytes.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    self.held.push_str(&String::from_utf8_lossy(&self.bytes[..valid]));
                    match e.error_len() {
                        // Incomplete sequence at the end: wait for more bytes.
                        None => {
                            self.bytes.drain(..valid);
                            break;
                        }
                        // Invalid bytes: replace them now and go on with the rest.
                        Some(bad) => {
                            self.held.push(char::REPLACEMENT_CHARACTER);
                            self.bytes.drain(..valid + bad);
                        }
                    }
                }
            }
        }
        self.release()
    }

    fn release(&mut self) -> Released {
        if let Some(cut) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let text = self.held[..cut].to_string();
            self.held.clear();
            self.bytes.clear();
            return Released { text, stopped: true };
        }
        // Keep the longest tail that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if i > keep && self.held.ends_with(&s[..i]) {
                    keep = i;
                }
            }
        }
        let cut = self.held.len() - keep;
        let text = self.held[..cut].to_string();
        self.held.drain(..cut);
        Released { text, stopped: false }
    }

    /// Everything still held, at the end of generation.
    pub fn finish(&mut self) -> String {
        let mut out = std::mem::take(&mut self.held);
        out.push_str(&String::from_utf8_lossy(&self.bytes));
        self.bytes.clear();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_incomplete_utf8() {
        let mut t = TextStream::new(&[]);
        let euro = "€".as_bytes();
        assert_eq!(t.push(&euro[..1]).text, "");
        assert_eq!(t.push(&euro[1..]).text, "€");
        assert_eq!(t.push(b"\xff!").text, "\u{fffd}!");
    }

    #[test]
    fn stop_strings_cut_and_hold_back() {
        let mut t = TextStream::new(&["END".to_string()]);
        assert_eq!(t.push(b"abc E").text, "abc ");
        assert_eq!(t.push(b"N").text, "");
        let r = t.push(b"Dzzz");
        assert_eq!(
            r,
            Released {
                text: String::new(),
                stopped: true
            }
        );
        let mut t = TextStream::new(&["END".to_string()]);
        assert_eq!(t.push(b"xE").text, "x");
        assert_eq!(t.push(b"x").text, "Ex");
        assert_eq!(t.push(b"E").text, "");
        assert_eq!(t.finish(), "E");
    }
}
