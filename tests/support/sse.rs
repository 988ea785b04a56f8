//! A small SSE client over reqwest: parses frames per the EventSource spec
//! (fields id, event, data; comments; a blank line dispatches).

use std::time::Duration;

use futures::StreamExt;
use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub struct Frame {
    pub id: Option<String>,
    pub event: String,
    pub data: Value,
}

pub struct SseClient {
    stream: futures::stream::BoxStream<'static, reqwest::Result<bytes::Bytes>>,
    buf: String,
    pub comments: usize,
}

impl SseClient {
    /// Opens `url` with `Accept: text/event-stream` and optional `Last-Event-ID`.
    pub async fn connect(url: &str, token: &str, last_event_id: Option<i32>) -> SseClient {
        let mut req = reqwest::Client::new().get(url).bearer_auth(token).header("Accept", "text/event-stream");
        if let Some(id) = last_event_id {
            req = req.header("Last-Event-ID", id.to_string());
        }
        let res = req.send().await.unwrap();
        assert_eq!(res.status(), 200);
        let ct = res.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        SseClient { stream: res.bytes_stream().boxed(), buf: String::new(), comments: 0 }
    }

    /// The next frame, or `None` when the server closed the stream.
    pub async fn next(&mut self, within: Duration) -> Option<Frame> {
        let deadline = tokio::time::Instant::now() + within;
        let (mut id, mut event, mut data) = (None, String::from("message"), Vec::<String>::new());
        loop {
            while let Some(pos) = self.buf.find('\n') {
                let line: String = self.buf.drain(..=pos).collect();
                let line = line.trim_end_matches(['\n', '\r']);
                if line.is_empty() {
                    if data.is_empty() {
                        continue;
                    }
                    let data = serde_json::from_str(&data.join("\n")).expect("frame data is JSON");
                    return Some(Frame { id, event, data });
                }
                if line.starts_with(':') {
                    self.comments += 1;
                    continue;
                }
                let (field, value) = line.split_once(':').unwrap_or((line, ""));
                let value = value.strip_prefix(' ').unwrap_or(value);
                match field {
                    "id" => id = Some(value.to_string()),
                    "event" => event = value.to_string(),
                    "data" => data.push(value.to_string()),
                    _ => {}
                }
            }
            let chunk = tokio::time::timeout_at(deadline, self.stream.next()).await.expect("SSE frame timed out")?;
            self.buf.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        }
    }

    /// Frames until the stream ends (after `complete`).
    pub async fn collect(&mut self, within: Duration) -> Vec<Frame> {
        let mut frames = Vec::new();
        while let Some(f) = self.next(within).await {
            frames.push(f);
        }
        frames
    }
}
