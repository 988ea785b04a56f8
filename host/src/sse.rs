//! Server-sent events, read: the model's stream (the `llm` tool) and a run's
//! stream (the CLI) are both decoded here.

/// A line this long without a newline is not an event stream worth reading.
pub const LINE_BYTES_MAX: usize = 4 << 20;

/// Splits a server-sent-events body into each event's `data`, however the
/// body is cut into chunks (mid-line, mid-character, CRLF or LF).
#[derive(Default)]
pub struct SseDecoder {
    buf: Vec<u8>,
    data: Option<String>,
}

impl SseDecoder {
    pub fn feed(&mut self, bytes: &[u8], out: &mut Vec<String>) -> Result<(), String> {
        self.buf.extend_from_slice(bytes);
        let mut start = 0;
        while let Some(n) = self.buf[start..].iter().position(|&b| b == b'\n') {
            let line = &self.buf[start..start + n];
            start += n + 1;
            Self::line(&mut self.data, line, out)?;
        }
        self.buf.drain(..start);
        if self.buf.len() > LINE_BYTES_MAX {
            return Err(format!("the stream sent a line over {LINE_BYTES_MAX} bytes"));
        }
        Ok(())
    }

    /// The event still open when the body ends (its blank line never came).
    pub fn finish(&mut self) -> Result<Option<String>, String> {
        let mut out = Vec::new();
        if !self.buf.is_empty() {
            let rest = std::mem::take(&mut self.buf);
            Self::line(&mut self.data, &rest, &mut out)?;
        }
        out.extend(self.data.take());
        Ok(out.pop())
    }

    fn line(data: &mut Option<String>, line: &[u8], out: &mut Vec<String>) -> Result<(), String> {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let line = std::str::from_utf8(line).map_err(|_| "the stream is not UTF-8".to_string())?;
        if line.is_empty() {
            out.extend(data.take());
            return Ok(());
        }
        if line.starts_with(':') {
            return Ok(());
        }
        let (field, value) = match line.split_once(':') {
            Some((f, v)) => (f, v.strip_prefix(' ').unwrap_or(v)),
            None => (line, ""),
        };
        if field == "data" {
            match data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => *data = Some(value.to_string()),
            }
        }
        Ok(())
    }
}
