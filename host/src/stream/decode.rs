//! Server-sent events, read: the one decoder for every SSE body this crate
//! (and its tests) consumes — a model's stream (the `llm` tool), a run's
//! stream (the CLI, the benchmark, the test client).
//!
//! It works on bytes and turns a line into text only once the line is whole,
//! so a character split across reads is put back together; CRLF and LF both
//! end a line. A line and one event's `data` (its `data:` lines joined) are
//! bounded in bytes: past a bound it errors instead of growing.

/// A line this long without a newline is not an event stream worth reading.
pub const LINE_BYTES_MAX: usize = 4 << 20;
/// One event's `data`, all its lines together.
pub const DATA_BYTES_MAX: usize = 4 << 20;

/// Why a body could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("the stream sent a line over {0} bytes")]
    LineTooLong(usize),
    #[error("the stream sent an event whose data is over {0} bytes")]
    DataTooLarge(usize),
    #[error("the stream is not UTF-8")]
    NotUtf8,
}

impl From<DecodeError> for String {
    fn from(e: DecodeError) -> String {
        e.to_string()
    }
}

/// One dispatched event: its `id` and `event` fields (if it had them) and
/// its `data` lines joined with `\n`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Frame {
    pub id: Option<String>,
    pub event: Option<String>,
    pub data: String,
}

/// Splits a server-sent-events body into events, however the body is cut
/// into chunks (mid-line, mid-character, CRLF or LF).
#[derive(Debug)]
pub struct SseDecoder {
    buf: Vec<u8>,
    /// Bytes of `buf` already searched for a newline.
    scanned: usize,
    line_bytes_max: usize,
    open: Open,
}

/// The event being read, and what was read around it.
#[derive(Debug)]
struct Open {
    id: Option<String>,
    event: Option<String>,
    /// `None` until a `data` line came: an event without one is not dispatched.
    data: Option<String>,
    data_bytes_max: usize,
    comments: u64,
}

impl Default for SseDecoder {
    fn default() -> Self {
        Self::with_bounds(LINE_BYTES_MAX, DATA_BYTES_MAX)
    }
}

impl SseDecoder {
    pub fn with_bounds(line_bytes_max: usize, data_bytes_max: usize) -> Self {
        let open = Open { id: None, event: None, data: None, data_bytes_max, comments: 0 };
        SseDecoder { buf: Vec::new(), scanned: 0, line_bytes_max, open }
    }

    /// Comment lines (`: ...`, keepalives) seen so far.
    pub fn comments(&self) -> u64 {
        self.open.comments
    }

    /// Feeds a chunk; each event it completes goes to `out` as its data.
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<String>) -> Result<(), DecodeError> {
        let mut frames = Vec::new();
        let fed = self.feed_frames(bytes, &mut frames);
        out.extend(frames.into_iter().map(|f| f.data));
        fed
    }

    /// Feeds a chunk; each event it completes goes to `out` whole.
    pub fn feed_frames(&mut self, bytes: &[u8], out: &mut Vec<Frame>) -> Result<(), DecodeError> {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(n) = self.buf[self.scanned..].iter().position(|&b| b == b'\n') {
            let end = self.scanned + n;
            self.open.line(&self.buf[start..end], self.line_bytes_max, out)?;
            start = end + 1;
            self.scanned = start;
        }
        self.buf.drain(..start);
        self.scanned = self.buf.len();
        if self.buf.len() > self.line_bytes_max {
            return Err(DecodeError::LineTooLong(self.line_bytes_max));
        }
        Ok(())
    }

    /// The event still open when the body ends (its blank line never came), as its data.
    pub fn finish(&mut self) -> Result<Option<String>, DecodeError> {
        Ok(self.finish_frame()?.map(|f| f.data))
    }

    /// The event still open when the body ends, whole.
    pub fn finish_frame(&mut self) -> Result<Option<Frame>, DecodeError> {
        let mut out = Vec::new();
        let rest = std::mem::take(&mut self.buf);
        self.scanned = 0;
        if !rest.is_empty() {
            self.open.line(&rest, self.line_bytes_max, &mut out)?;
        }
        self.open.dispatch(&mut out);
        Ok(out.pop())
    }
}

impl Open {
    fn dispatch(&mut self, out: &mut Vec<Frame>) {
        let (id, event) = (self.id.take(), self.event.take());
        if let Some(data) = self.data.take() {
            out.push(Frame { id, event, data });
        }
    }

    fn line(&mut self, line: &[u8], line_bytes_max: usize, out: &mut Vec<Frame>) -> Result<(), DecodeError> {
        if line.len() > line_bytes_max {
            return Err(DecodeError::LineTooLong(line_bytes_max));
        }
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let line = std::str::from_utf8(line).map_err(|_| DecodeError::NotUtf8)?;
        if line.is_empty() {
            self.dispatch(out);
            return Ok(());
        }
        if line.starts_with(':') {
            self.comments += 1;
            return Ok(());
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        match field {
            "data" => {
                // The bound holds across lines: the joining newline counts.
                let held = self.data.as_ref().map_or(0, |d| d.len() + 1);
                if held + value.len() > self.data_bytes_max {
                    return Err(DecodeError::DataTooLarge(self.data_bytes_max));
                }
                match &mut self.data {
                    Some(d) => {
                        d.push('\n');
                        d.push_str(value);
                    }
                    None => self.data = Some(value.to_string()),
                }
            }
            "id" => self.id = Some(value.to_string()),
            "event" => self.event = Some(value.to_string()),
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: &str = ": hello\n\nid: 1\nevent: content_delta\ndata: {\"delta\":\"h\u{e9}llo \u{1f600}\"}\n\n\
                        id: 2\r\nevent: note\r\ndata: line one\r\ndata: line two\r\n\r\n: keepalive\n";

    fn whole() -> Vec<Frame> {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        d.feed_frames(BODY.as_bytes(), &mut out).unwrap();
        assert_eq!(d.finish_frame().unwrap(), None);
        assert_eq!(d.comments(), 2);
        out
    }

    #[test]
    fn frames_keep_their_id_event_and_data() {
        let frames = whole();
        assert_eq!(
            frames,
            [
                Frame {
                    id: Some("1".into()),
                    event: Some("content_delta".into()),
                    data: "{\"delta\":\"h\u{e9}llo \u{1f600}\"}".into()
                },
                Frame { id: Some("2".into()), event: Some("note".into()), data: "line one\nline two".into() },
            ]
        );
    }

    /// Every cut, including inside the two- and four-byte characters: the
    /// same frames (the old test client panicked on a character cut in two).
    #[test]
    fn a_character_split_across_reads_is_put_back_together() {
        let bytes = BODY.as_bytes();
        let want = whole();
        for cut in 1..bytes.len() {
            let mut d = SseDecoder::default();
            let mut out = Vec::new();
            d.feed_frames(&bytes[..cut], &mut out).unwrap();
            d.feed_frames(&bytes[cut..], &mut out).unwrap();
            assert_eq!(out, want, "cut at byte {cut}");
        }
        for size in 1..=5 {
            let mut d = SseDecoder::default();
            let mut out = Vec::new();
            for piece in bytes.chunks(size) {
                d.feed_frames(piece, &mut out).unwrap();
            }
            assert_eq!(out, want, "chunks of {size}");
            assert_eq!(d.comments(), 2);
        }
    }

    #[test]
    fn data_over_its_bound_is_an_error_across_lines_and_reads() {
        let mut d = SseDecoder::with_bounds(64, 10);
        let mut out = Vec::new();
        d.feed(b"data: 12345\n", &mut out).unwrap();
        // 5 + 1 (the joining newline) + 4 = 10: at the bound, fine.
        d.feed(b"data: 1234\n\n", &mut out).unwrap();
        assert_eq!(out, ["12345\n1234"]);
        d.feed(b"data: 12345\ndata: ", &mut out).unwrap();
        assert_eq!(d.feed(b"12345\n", &mut out), Err(DecodeError::DataTooLarge(10)));
        // One line over the data bound alone.
        let mut d = SseDecoder::with_bounds(64, 10);
        assert_eq!(d.feed(b"data: 12345678901\n", &mut Vec::new()), Err(DecodeError::DataTooLarge(10)));
    }

    #[test]
    fn a_line_over_its_bound_is_an_error_whole_or_unfinished() {
        let mut d = SseDecoder::with_bounds(16, 1024);
        assert_eq!(d.feed(&[b'x'; 17], &mut Vec::new()), Err(DecodeError::LineTooLong(16)));
        let mut d = SseDecoder::with_bounds(16, 1024);
        let mut line = b"data: ".to_vec();
        line.extend([b'y'; 20]);
        line.push(b'\n');
        assert_eq!(d.feed(&line, &mut Vec::new()), Err(DecodeError::LineTooLong(16)));
        // Read a byte at a time, the unfinished line still hits the bound.
        let mut d = SseDecoder::with_bounds(16, 1024);
        let fed: Result<Vec<()>, _> = [b'z'; 40].chunks(1).map(|c| d.feed(c, &mut Vec::new())).collect();
        assert_eq!(fed, Err(DecodeError::LineTooLong(16)));
    }

    #[test]
    fn bytes_that_are_not_utf8_are_an_error() {
        let mut d = SseDecoder::default();
        assert_eq!(d.feed(b"data: \xff\xfe\n\n", &mut Vec::new()), Err(DecodeError::NotUtf8));
    }

    #[test]
    fn a_last_event_without_its_blank_line_still_counts() {
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        d.feed(b"data: a\ndata: b\n\ndata: [DONE]", &mut out).unwrap();
        assert_eq!(out, ["a\nb"]);
        assert_eq!(d.finish().unwrap().as_deref(), Some("[DONE]"));
        // An event with an id but no data is not dispatched (as EventSource).
        let mut d = SseDecoder::default();
        let mut out = Vec::new();
        d.feed_frames(b"id: 7\n\n", &mut out).unwrap();
        assert!(out.is_empty());
    }
}
