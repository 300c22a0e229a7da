//! Turning committed tokens into streamed text: UTF-8-safe incremental detokenisation, and stop
//! sequences that may span token and chunk boundaries.

/// Decodes a growing token list into text deltas without ever splitting a character.
///
/// Byte-level tokenisers spread one character over several tokens, and some tokens only form text
/// together with their neighbours, so a token cannot be decoded alone. Like TGI, we decode a short
/// window twice (before and after the new tokens) and emit the difference once it no longer ends in
/// U+FFFD, the mark of an incomplete UTF-8 sequence. The window restarts after each emission, so the
/// cost per token is constant.
#[derive(Debug, Clone, Default)]
pub struct IncrementalDecoder {
    tokens: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token; returns the text it completes, if any. `decode` turns ids into text.
    pub fn push<E>(
        &mut self,
        token: u32,
        decode: impl Fn(&[u32]) -> Result<String, E>,
    ) -> Result<Option<String>, E> {
        self.tokens.push(token);
        let prefix = decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full = decode(&self.tokens[self.prefix_offset..])?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(delta) = full.get(prefix.len()..) {
                if full.starts_with(&prefix) {
                    self.prefix_offset = self.read_offset;
                    self.read_offset = self.tokens.len();
                    return Ok(Some(delta.to_string()));
                }
            }
        }
        Ok(None)
    }

    /// The text still held back at the end of generation (an incomplete character is emitted as
    /// U+FFFD: the model really produced invalid UTF-8).
    pub fn finish<E>(&mut self, decode: impl Fn(&[u32]) -> Result<String, E>) -> Result<String, E> {
        let prefix = decode(&self.tokens[self.prefix_offset..self.read_offset])?;
        let full = decode(&self.tokens[self.prefix_offset..])?;
        self.prefix_offset = self.tokens.len();
        self.read_offset = self.tokens.len();
        Ok(match full.strip_prefix(&prefix) {
            Some(rest) => rest.to_string(),
            None => String::new(),
        })
    }
}

/// What [`StopMatcher::push`] decided.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StopStep {
    /// Text safe to send now.
    pub emit: String,
    /// A stop sequence was found: `emit` ends right before it and generation must end.
    pub stopped: bool,
}

/// Finds stop sequences in streamed text, holding back any tail that could still become one, so the
/// stop text is never sent even when it arrives split across tokens or chunks.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    held: String,
}

impl StopMatcher {
    /// Empty stop strings are ignored (they would match everywhere).
    pub fn new(stops: impl IntoIterator<Item = String>) -> Self {
        Self { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new() }
    }

    pub fn push(&mut self, text: &str) -> StopStep {
        self.held.push_str(text);
        if let Some(at) = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min() {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return StopStep { emit, stopped: true };
        }
        let keep = self.longest_partial_suffix();
        let emit = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopStep { emit, stopped: false }
    }

    /// Generation ended without a stop: whatever was held back is plain text after all.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length in bytes of the longest suffix of `held` that is a proper prefix of some stop string.
    fn longest_partial_suffix(&self) -> usize {
        let held = self.held.as_str();
        let mut best = 0;
        for stop in &self.stops {
            let max = stop.len().saturating_sub(1).min(held.len());
            for len in (best + 1..=max).rev() {
                let start = held.len() - len;
                if held.is_char_boundary(start) && stop.starts_with(&held[start..]) {
                    best = len;
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    /// A byte-level "tokeniser": token id = byte.
    fn bytes(ids: &[u32]) -> Result<String, Infallible> {
        Ok(String::from_utf8_lossy(&ids.iter().map(|&b| b as u8).collect::<Vec<_>>()).into_owned())
    }

    fn stream(text: &str) -> Vec<String> {
        let mut dec = IncrementalDecoder::new();
        let mut out: Vec<String> =
            text.bytes().filter_map(|b| dec.push(b as u32, bytes).unwrap()).collect();
        out.push(dec.finish(bytes).unwrap());
        out
    }

    #[test]
    fn never_splits_a_character() {
        let text = "héllo wörld 🎉 日本語!";
        let pieces = stream(text);
        assert_eq!(pieces.concat(), text);
        assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')));
        // The 4-byte emoji comes out whole, in one piece.
        assert!(pieces.iter().any(|p| p == "🎉"));
    }

    #[test]
    fn invalid_utf8_at_the_end_is_flushed_as_replacement() {
        let mut dec = IncrementalDecoder::new();
        assert_eq!(dec.push(b'a' as u32, bytes).unwrap().as_deref(), Some("a"));
        assert_eq!(dec.push(0xF0, bytes).unwrap(), None);
        assert_eq!(dec.finish(bytes).unwrap(), "\u{FFFD}");
    }

    fn run_stops(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()));
        let mut out = String::new();
        for p in pieces {
            let step = m.push(p);
            out.push_str(&step.emit);
            if step.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stop_spanning_pieces_is_never_emitted() {
        assert_eq!(run_stops(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), true));
        assert_eq!(run_stops(&["\n\n"], &["a\n", "\nb"]), ("a".into(), true));
        // The earliest of several stops wins.
        assert_eq!(run_stops(&["xyz", "b"], &["axy", "zb"]), ("a".into(), true));
    }

    #[test]
    fn partial_match_that_fails_is_released() {
        assert_eq!(run_stops(&["END"], &["E", "N", "x"]), ("ENx".into(), false));
        assert_eq!(run_stops(&["END"], &["xx EN"]), ("xx EN".into(), false));
    }

    #[test]
    fn held_text_is_minimal() {
        let mut m = StopMatcher::new(["stop".to_string()]);
        assert_eq!(m.push("hello st").emit, "hello ");
        assert_eq!(m.push("x").emit, "stx");
    }

    #[test]
    fn multibyte_stops_and_text() {
        assert_eq!(run_stops(&["é!"], &["caf", "é", "!"]), ("caf".into(), true));
        assert_eq!(run_stops(&["🎉"], &["a🎉b"]), ("a".into(), true));
        assert_eq!(run_stops(&["ab"], &["ééa"]), ("ééa".into(), false));
    }

    #[test]
    fn empty_stop_strings_are_ignored() {
        assert_eq!(run_stops(&[""], &["abc"]), ("abc".into(), false));
    }
}
